"""Stopping and limits: EOS inside an accepted run, max_new_tokens mid-run, the context edge."""

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.config import SpecConfig
from eagle_jax.generate import Generator, PromptError
from eagle_jax.spec_decode import loop
from eagle_jax.spec_decode.stats import SpecStats

from spec_helpers import random_prompts, tiny_drafter, tiny_target, with_eos

CHAIN = SpecConfig("chain", num_speculative_tokens=4)


def _state(gen, max_new, prompt_len, done=False):
    b = len(gen)
    return loop.DecodeState(
        tcache=None, dcache=None, pending=jnp.zeros((b,), jnp.int32), root_hidden=None,
        out=jnp.zeros((b, 16), jnp.int32), num_generated=jnp.asarray(gen, jnp.int32),
        done=jnp.full((b,), done), prompt_len=jnp.asarray(prompt_len, jnp.int32),
        max_new=jnp.asarray(max_new, jnp.int32), keys=jnp.zeros((b, 2), jnp.uint32), sampling=None,
        stats=SpecStats.zeros(b, 4))


def _lc(eos=(9,), limit=100):
    tcfg, _ = tiny_target()
    return loop.LoopConfig(tcfg, None, CHAIN, eos_ids=eos, context_limit=limit)


def test_emit_stops_at_eos_inside_accepted_run():
    state, m = loop._emit(_state([3], [10], [5]), _lc(), jnp.array([[5, 9, 6, 7, 1]]), jnp.array([5]))
    assert int(m[0]) == 2 and bool(state.done[0])
    assert np.asarray(state.out[0, 3:5]).tolist() == [5, 9] and int(state.num_generated[0]) == 5
    assert np.asarray(state.out[0, 5:]).tolist() == [0] * 11  # nothing after EOS


def test_emit_respects_max_new_tokens_mid_run():
    state, m = loop._emit(_state([8], [10], [5]), _lc(), jnp.array([[5, 6, 7, 1, 2]]), jnp.array([5]))
    assert int(m[0]) == 2 and bool(state.done[0]) and int(state.num_generated[0]) == 10


def test_emit_respects_context_limit_and_finished_rows():
    state, m = loop._emit(_state([2, 2], [50, 50], [95, 10]), _lc(limit=100),
                          jnp.array([[5, 6, 7, 1, 2], [5, 6, 7, 1, 2]]), jnp.array([5, 3]))
    assert np.asarray(m).tolist() == [3, 3]
    assert np.asarray(state.done).tolist() == [True, False]
    _, m = loop._emit(_state([2], [50], [10], done=True), _lc(), jnp.array([[5, 6]]), jnp.array([2]))
    assert int(m[0]) == 0


@pytest.fixture(scope="module")
def tiny():
    tcfg, tparams = tiny_target(vocab=8)
    return tcfg, tparams, tiny_drafter(tcfg, "eagle3", draft_vocab=6)


def test_eos_matches_plain_decoding(tiny):
    tcfg, tparams, d = tiny
    prompts = random_prompts(8, [7, 12, 3])
    free = Generator(tcfg, tparams).generate(prompts, max_new_tokens=30).token_ids
    eos = free[0][5]  # a token that row 0 emits after a few steps
    cfg = with_eos(tcfg, [eos])
    plain = Generator(cfg, tparams).generate(prompts, max_new_tokens=30)
    spec = Generator(cfg, tparams, drafter=d, spec=CHAIN).generate(prompts, max_new_tokens=30)
    assert spec.token_ids == plain.token_ids
    assert spec.token_ids[0][-1] == eos and spec.finish_reasons[0] == "eos"
    assert len(spec.token_ids[0]) <= 6


@pytest.mark.parametrize("room", [1, 3])
def test_context_edge(tiny, room):
    """room=1: the prompt ends one token short of the limit; room=3: a k=4 chain would cross it."""
    tcfg, tparams, d = tiny
    prompt = random_prompts(8, [20])[0]
    limit = len(prompt) + room
    plain = Generator(tcfg, tparams, context_limit=limit).generate([prompt], max_new_tokens=10)
    spec = Generator(tcfg, tparams, drafter=d, spec=CHAIN, context_limit=limit).generate([prompt], max_new_tokens=10)
    assert len(plain.token_ids[0]) == room
    assert spec.token_ids == plain.token_ids and spec.finish_reasons == ["context"]


def test_prompt_filling_the_context_is_rejected(tiny):
    tcfg, tparams, d = tiny
    gen = Generator(tcfg, tparams, drafter=d, spec=CHAIN, context_limit=16)
    with pytest.raises(PromptError, match="16"):
        gen.generate([list(range(8)) * 2], max_new_tokens=4)


def test_rows_finish_at_different_steps(tiny):
    tcfg, tparams, d = tiny
    prompts = random_prompts(8, [4, 9, 15, 2])
    max_new = [1, 17, 5, 30]
    plain = Generator(tcfg, tparams).generate(prompts, max_new_tokens=max_new)
    spec = Generator(tcfg, tparams, drafter=d, spec=SpecConfig("tree", tree_top_k=2, tree_depth=3,
                                                              tree_total_tokens=7)).generate(prompts, max_new_tokens=max_new)
    assert spec.token_ids == plain.token_ids
    assert [len(t) for t in spec.token_ids] == max_new
    steps = [r["num_verify_steps"] for r in spec.row_stats]
    assert steps[0] == 0 and steps[3] > steps[2]  # row 0 finished at prefill
