"""loop.step_rows: a step over the first rows of a batched state (the engine's row buckets).

Against an independent reference: the same steps run by `loop.step` on a
state holding only those rows. The rows past the bucket must come out bit
for bit as they went in, caches included, on the native CPU path (where the
step works on views of the whole caches, in place) and on the XLA path
(where it copies the rows out and back).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.config import SpecConfig, TargetConfig
from eagle_jax.engine.batch import batch_inputs
from eagle_jax.generate import Generator
from eagle_jax.kernels import cpu
from eagle_jax.models import target
from eagle_jax.spec_decode import loop

from spec_helpers import random_prompts, smollm2_random_drafter

IMPLS = ["xla", pytest.param("native", marks=pytest.mark.skipif(not cpu.available(), reason="native kernels"))]
METHODS = {"plain": None, "chain": SpecConfig("chain", num_speculative_tokens=3),
           "tree": SpecConfig("tree", tree_top_k=3, tree_depth=3, tree_total_tokens=8)}


def _generator(impl, spec):
    # head_dim 64: the shape the native attention takes; a tiny vocabulary so drafts are accepted.
    cfg = TargetConfig(vocab_size=8, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4,
                       num_kv_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5)
    params = target.init_params(cfg, jax.random.PRNGKey(0), scale=0.3)
    if spec is None:
        return Generator(cfg, params, impl=impl)
    d = smollm2_random_drafter(cfg, "eagle3.1", draft_vocab=6, scale=0.3)
    return Generator(cfg, params, drafter=d, spec=spec, impl=impl)


def _prefilled(gen, prompts):
    ids = gen.encode_prompts(prompts, chat=False)
    lc, args, static = batch_inputs(gen, ids, gen.requests(len(ids), max_new_tokens=24))
    dparams, vocab = gen.drafter_for(lc)
    return lc, dparams, vocab, loop.prefill_jit(gen.target_params, dparams, vocab, *args, **static)


def _rows(state, lo, hi):
    """The state of rows [lo, hi) (cache k/v sliced along their batch axis), as fresh arrays."""
    def take(path, x):
        axis = 1 if any(getattr(p, "name", None) in ("k", "v") for p in path) else 0
        return jnp.array(jax.lax.slice_in_dim(x, lo, hi, axis=axis), copy=True)
    return jax.tree_util.tree_map_with_path(take, state)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", list(METHODS))
def test_step_rows_steps_the_head_and_leaves_the_tail(impl, method):
    gen = _generator(impl, METHODS[method])
    prompts = random_prompts(8, [9, 5, 13, 7])
    lc, dparams, vocab, state = _prefilled(gen, prompts)
    head, tail = _rows(state, 0, 2), _rows(state, 2, 4)  # the reference steps a state of the 2 rows alone
    for _ in range(3):
        state = loop.step_rows_jit(gen.target_params, dparams, vocab, state, lc=lc, rows=2)
        head = loop.step_jit(gen.target_params, dparams, vocab, head, lc=lc)
    assert int(state.num_generated[0]) > 3  # the head rows did advance
    jax.tree.map(np.testing.assert_array_equal, _rows(state, 0, 2), _rows(head, 0, 2))
    jax.tree.map(np.testing.assert_array_equal, _rows(state, 2, 4), tail)


def _pick(state, rows):
    """The state of the given rows, in that order (cache k/v along their batch axis)."""
    def take(path, x):
        axis = 1 if any(getattr(p, "name", None) in ("k", "v") for p in path) else 0
        return jnp.take(x, jnp.asarray(rows), axis=axis)
    return jax.tree_util.tree_map_with_path(take, state)


def test_step_rows_in_row_groups_steps_the_head_of_each_group():
    """With `row_groups=2` (the engine on a mesh whose data axis of 2 holds rows [0, 2) and
    [2, 4)) a step over 2 rows steps the first row of each group, rows 0 and 2, as a state of
    those rows alone, and leaves rows 1 and 3 as they were."""
    gen = _generator("xla", METHODS["chain"])
    lc, dparams, vocab, state = _prefilled(gen, random_prompts(8, [9, 5, 13, 7]))
    grouped = dataclasses.replace(lc, row_groups=2)
    head, rest = _pick(state, [0, 2]), _pick(state, [1, 3])
    for _ in range(3):
        state = loop.step_rows_jit(gen.target_params, dparams, vocab, state, lc=grouped, rows=2)
        head = loop.step_jit(gen.target_params, dparams, vocab, head, lc=lc)
    assert int(state.num_generated[2]) > 3  # the second group's head did advance
    jax.tree.map(np.testing.assert_array_equal, _pick(state, [0, 2]), head)
    jax.tree.map(np.testing.assert_array_equal, _pick(state, [1, 3]), rest)


def test_step_rows_over_every_row_steps_each_row_as_alone():
    """step_rows over every row of the state against each row stepped alone, as a batch of one
    (`step` over the whole state would be the very call step_rows makes: no reference)."""
    gen = _generator("xla", METHODS["chain"])
    lc, dparams, vocab, state = _prefilled(gen, random_prompts(8, [6, 11]))
    alone = [_rows(state, r, r + 1) for r in range(2)]
    for _ in range(3):
        state = loop.step_rows_jit(gen.target_params, dparams, vocab, state, lc=lc, rows=2)
        alone = [loop.step_jit(gen.target_params, dparams, vocab, a, lc=lc) for a in alone]
    assert int(state.num_generated.min()) > 3  # every row advanced
    for r, a in enumerate(alone):
        got = _rows(state, r, r + 1)
        for name in ("out", "num_generated", "done", "pending"):  # tokens: exactly
            np.testing.assert_array_equal(getattr(got, name), getattr(a, name), err_msg=f"row {r} {name}")
        # floats: a one-row batch may take other XLA:CPU dot kernels than a two-row one
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5), got, a)


@pytest.mark.skipif(not cpu.available(), reason="native kernels")
def test_native_step_rows_copies_no_cache():
    """On the native path the caches pass from kernel to kernel in place: in the compiled step no
    op but the kernels' custom calls (and the tuples and parameters that carry them) yields a
    cache-sized array; a slice of the first rows, a copy or an update-slice back would."""
    gen = _generator("native", METHODS["tree"])
    lc, dparams, vocab, state = _prefilled(gen, random_prompts(8, [9, 5, 13, 7]))
    assert state.dcache is not None
    hlo = loop.step_rows_jit.trace(gen.target_params, dparams, vocab, state, lc=lc, rows=2).lower().compile().as_text()
    shapes = [f"f32[{','.join(map(str, c.k.shape))}]" for c in (state.tcache, state.dcache)]
    carriers = ("custom-call(", "parameter(", "tuple(", "get-tuple-element(", "bitcast(")
    work = [line.strip()[:160] for line in hlo.splitlines()
            if " = " in line and any(s in line.split(" = ", 1)[1].split(")")[0] + ")" for s in shapes)
            and not any(c in line for c in carriers)]
    assert not work, work
    assert sum("custom-call(" in line and shapes[0] in line for line in hlo.splitlines()) >= 3
