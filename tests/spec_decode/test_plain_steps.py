"""Steps of one speculative state at different draft depths (`loop.step(..., depth=d)`):
at depth 0 the target alone emits the token and the drafter still rolls
forward over it; shallower steps draft `SpecConfig.at_depth(d)`. So a slot
engine may change the depth, down to plain, from one step to the next.

References: the target's greedy tokens from plain steps alone (the output may
not depend on which steps drafted), the same for sampled rows with the coupled
sampler (against a target with no drafter at all), and a fresh prefill over
the prompt plus the tokens so far (the drafter's root prediction after plain
steps must be the one it would have had from the start)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.config import SpecConfig
from eagle_jax.engine.batch import batch_inputs, run_batch
from eagle_jax.engine.request import Sampling
from eagle_jax.models import drafter
from eagle_jax.spec_decode import loop

from spec_helpers import random_prompts
from test_step_rows import IMPLS, _generator, _prefilled

SPECS = {"chain": SpecConfig("chain", num_speculative_tokens=3),
         "tree": SpecConfig("tree", tree_top_k=3, tree_depth=3, tree_total_tokens=8)}


def _lazy(gen, prompts, width, rows=None):
    """(lc, dparams, vocab, prefilled state) with a lazy drafter (`width` > 0): the prefill leaves the
    prompt to `catch_up` (`width` positions a call), in whole-cache buffers as the engine holds them.
    rows: the prompts' `Sampling`s (default: greedy, 24 tokens)."""
    ids = gen.encode_prompts(prompts, chat=False)
    lc, args, static = batch_inputs(gen, ids, rows or gen.requests(len(ids), max_new_tokens=24))
    lc = dataclasses.replace(lc, catch_up_width=width)
    dparams, vocab = gen.drafter_for(lc)
    state = loop.prefill_jit(gen.target_params, dparams, vocab, *args, lc=lc, out_width=static["out_width"])
    if width:
        feats, toks = loop.create_feats(lc, len(prompts), state.tcache.max_len)
        p = state.feats.shape[1]
        state = state.replace(feats=feats.at[:, :p].set(state.feats), feat_tokens=toks.at[:, :p].set(state.feat_tokens))
    return lc, dparams, vocab, state


def _level(gen, dparams, lc, state):
    """catch_up until the drafter is level with the target in every row."""
    while lc.catch_up_width and bool(jnp.any(state.dcache.lengths < state.tcache.lengths)):
        state = loop.catch_up_rows_jit(gen.target_params, dparams, state, lc=lc, rows=state.pending.shape[0])
    return state


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("width", [0, 2])
def test_switching_draft_depths_keeps_greedy_output(impl, method, width):
    gen = _generator(impl, SPECS[method])
    prompts = random_prompts(8, [9, 5, 13])
    plain_lc, _, _, plain = _prefilled(gen, prompts)
    lc, dparams, vocab, state = _lazy(gen, prompts, width)
    depths = [0, 3, 0, 1, 3, 2, 0, 0, 0, 3]
    for depth in depths:
        if depth:
            state = _level(gen, dparams, lc, state)
        state = loop.step_jit(gen.target_params, dparams, vocab, state, lc=lc, depth=depth)
    while int(jnp.min(plain.num_generated)) < int(jnp.max(state.num_generated)):
        plain = loop.step_jit(gen.target_params, dparams, vocab, plain, lc=plain_lc, depth=0)
    n = np.asarray(state.num_generated)
    assert n.min() > 8 and int(jnp.sum(state.stats.accepted)) > 0  # some drafts were accepted
    assert np.asarray(state.stats.steps).max() == 5  # only the drafting steps count as verify steps
    assert np.asarray(state.stats.drafted).max() == sum(depths)  # each verify step drafted its own depth
    for b in range(len(prompts)):
        np.testing.assert_array_equal(np.asarray(state.out[b, :n[b]]), np.asarray(plain.out[b, :n[b]]))


@pytest.mark.parametrize("method", list(SPECS))
def test_switching_draft_depths_keeps_coupled_samples(method):
    """Sampled rows (one greedy, some with top-k / top-p) on the coupled sampler, stepped at
    changing depths with a lazy drafter, emit token for token what plain decoding by the same
    target without a drafter samples with the same seeds: the depth a step drafts at, or
    whether it drafts, changes no sampled token."""
    gen = _generator("xla", SPECS[method])
    prompts = random_prompts(8, [9, 5, 13, 7])
    rows = [Sampling(max_new_tokens=24, temperature=0.7, seed=3), Sampling(max_new_tokens=24, temperature=1.0, seed=4),
            Sampling(max_new_tokens=24, temperature=1.3, top_k=5, top_p=0.9, seed=5, seed_stream=2),
            Sampling(max_new_tokens=24)]
    lc, dparams, vocab, state = _lazy(gen, prompts, 2, rows)
    for depth in [3, 0, 1, 3, 2, 0, 3, 3, 1, 0, 3, 3]:
        if depth:
            state = _level(gen, dparams, lc, state)
        state = loop.step_jit(gen.target_params, dparams, vocab, state, lc=lc, depth=depth)
    plain = run_batch(_generator("xla", None), gen.encode_prompts(prompts, chat=False), rows)
    n = np.asarray(state.num_generated)
    steps, accepted, drafted = (int(np.sum(getattr(state.stats, k))) for k in ("steps", "accepted", "drafted"))
    assert n.min() > 12 and 0 < accepted < drafted  # drafts were accepted, and rejected
    for b in range(len(prompts)):
        np.testing.assert_array_equal(np.asarray(state.out[b, :n[b]]), plain.tokens[b, :n[b]], err_msg=f"row {b}")


@pytest.mark.parametrize("width", [0, 2, 16])
def test_plain_steps_keep_the_drafter_where_a_prefill_would_put_it(width):
    """Rolled at the prefill and each plain step, or caught up afterwards over the prompt and the
    plain steps (2 positions a call: 8 calls; 16: 1)."""
    gen = _generator("xla", SPECS["chain"])
    prompts = random_prompts(8, [9, 12])
    lc, dparams, vocab, state = _lazy(gen, prompts, width)
    for _ in range(3):
        state = loop.step_jit(gen.target_params, dparams, vocab, state, lc=lc, depth=0)
    if width:
        np.testing.assert_array_equal(np.asarray(state.dcache.lengths), [0, 0])  # the drafter read nothing
        state = _level(gen, dparams, lc, state)
    out = np.asarray(state.out)
    longer = [list(p) + out[b, :3].tolist() for b, p in enumerate(prompts)]  # all but the pending token
    _, _, _, fresh = _prefilled(gen, longer)
    np.testing.assert_array_equal(np.asarray(fresh.pending), np.asarray(state.pending))
    np.testing.assert_array_equal(np.asarray(fresh.dcache.lengths), np.asarray(state.dcache.lengths))
    # The root's prediction and feedback (the drafter's pre-norm output itself is ~100x larger).
    model = drafter.Drafter(lc.drafter, dparams)
    for got, want in zip(model.head(state.root_hidden, impl="xla"), model.head(fresh.root_hidden, impl="xla")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
