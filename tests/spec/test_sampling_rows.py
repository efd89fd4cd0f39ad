"""Per-row sampling settings: arrays of one compiled program (the serving issue).

Claims checked:
* the sort-free top-k / top-p filter (a bisection over the float order) keeps
  exactly the tokens the sort-based rule keeps, row by row, for a batch whose
  rows ask for different temperatures, top-k and top-p;
* tied tokens at a top-k or top-p boundary are kept or dropped together;
* in one batch mixing settings (and a greedy row), every row samples exactly
  what it samples alone with the same seed, plain, chain and tree; the greedy
  row equals greedy decoding;
* new temperature / top-k / top-p values compile nothing;
* the two-level inverse-CDF draw follows its distribution (chi-square) and
  never draws a token of zero mass.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from eagle_jax.config import SamplingConfig, SpecConfig
from eagle_jax.generate import Generator, PromptError
from eagle_jax.spec import loop
from eagle_jax.spec.sampling import SamplingParams, process_logits, row_keys, sample_probs

from spec_helpers import random_prompts, tiny_drafter, tiny_target


def _sorted_rule(x, temperature, top_k, top_p):
    """One row by a full sort (the rule before per-row settings)."""
    x = x / temperature
    if 0 < top_k < x.shape[-1]:
        x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
    if top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        probs = np.exp(x[order] - x[order][0])
        probs /= probs.sum()
        keep = np.zeros(x.shape, bool)
        keep[order] = np.cumsum(probs) - probs < top_p
        x = np.where(keep, x, -np.inf)
    return x


ROWS = [SamplingConfig(0.7), SamplingConfig(1.0, top_k=5), SamplingConfig(0.5, top_p=0.9),
        SamplingConfig(1.3, top_k=50, top_p=0.8), SamplingConfig(0.9, top_k=1), SamplingConfig(2.0, top_p=0.3),
        SamplingConfig(1.0, top_k=999, top_p=0.999)]


def test_filters_keep_what_the_sorted_rule_keeps():
    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal((len(ROWS), 3, 1000))).astype(np.float32)
    got = np.asarray(jax.jit(process_logits)(jnp.asarray(x), SamplingParams.rows(ROWS)))
    for b, c in enumerate(ROWS):
        for r in range(3):
            want = _sorted_rule(x[b, r], c.temperature, c.top_k, c.top_p)
            np.testing.assert_array_equal(np.isfinite(got[b, r]), np.isfinite(want), err_msg=f"row {b}.{r}")
            kept = np.isfinite(want)
            np.testing.assert_allclose(got[b, r][kept], want[kept], rtol=1e-6)
    assert [int(np.isfinite(got[b, 0]).sum()) for b in (1, 4)] == [5, 1]


def test_ties_at_a_boundary_are_kept_together():
    x = jnp.asarray([[3.0, 2.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, -5.0]])
    params = SamplingParams.rows([SamplingConfig(1.0, top_k=2), SamplingConfig(1.0, top_p=0.3)])
    kept = np.isfinite(np.asarray(process_logits(x, params)))
    assert kept.tolist() == [[True, True, True, False, False], [True, True, True, True, False]]


def test_all_greedy_rows_carry_no_sampling_arrays():
    assert SamplingParams.rows([SamplingConfig(), SamplingConfig(0.0, top_k=3)]) is None


@pytest.fixture(scope="module")
def tiny():
    tcfg, tparams = tiny_target(vocab=16, seed=2, scale=0.4)
    return tcfg, tparams, random_prompts(16, [5, 8, 3, 6], seed=7)


SETTINGS = dict(temperature=[0.8, 0.0, 1.2, 0.6], top_k=[0, 5, 3, 0], top_p=[1.0, 1.0, 0.9, 0.7])


@pytest.mark.parametrize("spec", [None, SpecConfig("chain", num_speculative_tokens=3),
                                  SpecConfig("tree", tree_top_k=2, tree_depth=3, tree_total_tokens=6)],
                         ids=["plain", "chain", "tree"])
def test_each_row_of_a_mixed_batch_samples_as_it_would_alone(tiny, spec):
    tcfg, tparams, prompts = tiny
    drafter = tiny_drafter(tcfg, "eagle3.1", draft_vocab=12) if spec else None
    gen = Generator(tcfg, tparams, drafter=drafter, spec=spec or SpecConfig())
    seeds = [11, 12, 13, 14]
    batch = gen.generate(prompts, max_new_tokens=10, seed=seeds, **SETTINGS).token_ids
    for r, prompt in enumerate(prompts):
        alone = gen.generate([prompt], max_new_tokens=10, seed=[seeds[r]],
                             **{k: v[r] for k, v in SETTINGS.items()}).token_ids[0]
        assert batch[r] == alone, f"row {r}"
    assert batch[1] == gen.generate([prompts[1]], max_new_tokens=10).token_ids[0]  # the greedy row
    assert len({tuple(t) for t in batch}) == 4


def test_new_sampling_values_compile_nothing(tiny):
    tcfg, tparams, prompts = tiny
    gen = Generator(tcfg, tparams, drafter=tiny_drafter(tcfg, "eagle3", draft_vocab=12),
                    spec=SpecConfig("chain", num_speculative_tokens=2))
    gen.generate(prompts[:2], max_new_tokens=6, temperature=0.7)
    sizes = loop.prefill_jit._cache_size(), loop.run_jit._cache_size()
    for kw in (dict(temperature=1.3, top_k=4), dict(temperature=[0.2, 0.0], top_p=[0.5, 1.0]),
               dict(temperature=0.9, top_k=[1, 0], top_p=0.95)):
        gen.generate(prompts[:2], max_new_tokens=6, seed=3, **kw)
    assert (loop.prefill_jit._cache_size(), loop.run_jit._cache_size()) == sizes


def test_per_row_settings_must_match_the_prompts(tiny):
    tcfg, tparams, prompts = tiny
    gen = Generator(tcfg, tparams)
    with pytest.raises(PromptError, match=r"temperature must be one value or one per prompt \(2\), got 3"):
        gen.generate(prompts[:2], max_new_tokens=2, temperature=[0.5, 0.5, 0.5])
    # numpy arrays per prompt are taken as their Python values
    as_lists = gen.generate(prompts[:2], max_new_tokens=4, seed=[1, 2], temperature=[0.5, 0.9], top_k=[3, 0])
    as_arrays = gen.generate(prompts[:2], max_new_tokens=4, seed=[1, 2], temperature=np.array([0.5, 0.9]),
                             top_k=np.array([3, 0]))
    assert as_arrays.token_ids == as_lists.token_ids


def test_draws_follow_the_distribution_and_skip_zero_mass():
    rng = np.random.default_rng(5)
    v = 700  # three blocks of 256, the last one partial
    weights = rng.random(v) * (rng.random(v) < 0.3)  # unnormalised, most tokens of zero mass
    weights[[0, 255, 256, 699]] = [0.0, 2.0, 0.5, 1.5]  # block edges
    n = 20000
    keys = row_keys(jnp.arange(n, dtype=jnp.int32), jnp.zeros((n,), jnp.int32))
    draws = np.asarray(jax.jit(sample_probs)(keys, jnp.broadcast_to(jnp.asarray(weights, jnp.float32), (n, v))))
    assert np.all(weights[draws] > 0)
    counts = np.bincount(draws, minlength=v)
    expected = weights / weights.sum() * n
    big = expected >= 5
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3
