"""Steps of one speculative state at different draft depths (`loop.step(..., depth=d)`):
at depth 0 the target alone emits the token and the drafter still rolls
forward over it; shallower steps draft `SpecConfig.at_depth(d)`. So a slot
engine may change the depth, down to plain, from one step to the next.

References: the target's greedy tokens from plain steps alone (the output may
not depend on which steps drafted), and a fresh prefill over the prompt plus
the tokens so far (the drafter's root prediction after plain steps must be
the one it would have had from the start)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.config import SpecConfig
from eagle_jax.models import drafter
from eagle_jax.spec import loop

from spec_helpers import random_prompts
from test_step_rows import IMPLS, _generator, _prefilled

SPECS = {"chain": SpecConfig("chain", num_speculative_tokens=3),
         "tree": SpecConfig("tree", tree_top_k=3, tree_depth=3, tree_total_tokens=8)}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", list(SPECS))
def test_switching_draft_depths_keeps_greedy_output(impl, method):
    gen = _generator(impl, SPECS[method])
    prompts = random_prompts(8, [9, 5, 13])
    lc, dparams, vocab, state = _prefilled(gen, prompts)
    plain = jax.tree.map(jnp.copy, state)
    depths = [0, 3, 0, 1, 3, 2, 0, 3]
    for depth in depths:
        state = loop.step_jit(gen.target_params, dparams, vocab, state, lc=lc, depth=depth)
    while int(jnp.min(plain.num_generated)) < int(jnp.max(state.num_generated)):
        plain = loop.step_jit(gen.target_params, dparams, vocab, plain, lc=lc, depth=0)
    n = np.asarray(state.num_generated)
    assert n.min() > 8 and int(jnp.sum(state.stats.accepted)) > 0  # some drafts were accepted
    assert np.asarray(state.stats.steps).max() == 5  # only the drafting steps count as verify steps
    assert np.asarray(state.stats.drafted).max() == sum(depths)  # each verify step drafted its own depth
    for b in range(len(prompts)):
        np.testing.assert_array_equal(np.asarray(state.out[b, :n[b]]), np.asarray(plain.out[b, :n[b]]))


def test_plain_steps_keep_the_drafter_where_a_prefill_would_put_it():
    gen = _generator("xla", SPECS["chain"])
    prompts = random_prompts(8, [9, 12])
    lc, dparams, vocab, state = _prefilled(gen, prompts)
    for _ in range(3):
        state = loop.step_jit(gen.target_params, dparams, vocab, state, lc=lc, depth=0)
    out = np.asarray(state.out)
    longer = [list(p) + out[b, :3].tolist() for b, p in enumerate(prompts)]  # all but the pending token
    _, _, _, fresh = _prefilled(gen, longer)
    np.testing.assert_array_equal(np.asarray(fresh.pending), np.asarray(state.pending))
    np.testing.assert_array_equal(np.asarray(fresh.dcache.lengths), np.asarray(state.dcache.lengths))
    # The root's prediction and feedback (the drafter's pre-norm output itself is ~100x larger).
    for got, want in zip(drafter.head(dparams, lc.drafter, state.root_hidden, impl="xla"),
                         drafter.head(dparams, lc.drafter, fresh.root_hidden, impl="xla")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
