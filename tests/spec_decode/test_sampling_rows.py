"""Per-row sampling settings: arrays of one compiled program (the serving issue).

Claims checked:
* the sort-free top-k / top-p filters (the XLA path's bisection over the
  float order, and the native kernels' histogram and in-bucket select) keep
  exactly the tokens the sort-based rule keeps, row by row, for a batch whose
  rows ask for different temperatures, top-k and top-p, and at the target's
  vocabulary size on peaked, flat and heavily tied rows;
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
from eagle_jax.kernels import cpu
from eagle_jax.generate import Generator, PromptError
from eagle_jax.spec_decode import loop
from eagle_jax.spec_decode.sampling import SamplingParams, process_logits, row_keys, sample_probs

from spec_helpers import random_prompts, tiny_drafter, tiny_target


def _sorted_rule(x, temperature, top_k, top_p):
    """One row by a full sort, in float64 -> (logits kept, -inf elsewhere;
    each token's distance from the top-p boundary: |mass strictly above - p|,
    inf without top-p). Float32 sums over 49k tokens may round a token within
    about 1e-5 of the boundary either way."""
    x = x.astype(np.float64) / temperature
    near = np.full(x.shape, np.inf)
    if 0 < top_k < x.shape[-1]:
        x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
    if top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        probs = np.exp(x[order] - x[order][0])
        probs /= probs.sum()
        first = np.searchsorted(-x[order], -x[order], side="left")  # each token's first tie
        above = (np.cumsum(probs) - probs)[first]
        keep = np.zeros(x.shape, bool)
        keep[order] = above < top_p
        near[order] = np.abs(above - top_p)
        x = np.where(keep, x, -np.inf)
    return x, near


def _assert_same_kept(got, x, c, where):
    """The filter kept what the sorted rule keeps, up to float32 rounding at the top-p boundary."""
    want, near = _sorted_rule(x, c.temperature, c.top_k, c.top_p)
    differ = np.isfinite(got) != np.isfinite(want)
    assert np.all(near[differ] < 1e-5), f"{where}: {differ.sum()} tokens kept differently, away from the boundary"
    kept = np.isfinite(want) & np.isfinite(got)
    np.testing.assert_allclose(got[kept], want[kept], rtol=1e-6, err_msg=where)


IMPLS = ["xla", pytest.param("native", marks=pytest.mark.skipif(not cpu.available(), reason="native kernels"))]

ROWS = [SamplingConfig(0.7), SamplingConfig(1.0, top_k=5), SamplingConfig(0.5, top_p=0.9),
        SamplingConfig(1.3, top_k=50, top_p=0.8), SamplingConfig(0.9, top_k=1), SamplingConfig(2.0, top_p=0.3),
        SamplingConfig(1.0, top_k=999, top_p=0.999)]


def _filter(x, rows, impl):
    return np.asarray(jax.jit(lambda x, s: process_logits(x, s, impl=impl))(jnp.asarray(x), SamplingParams.rows(rows)))


@pytest.mark.parametrize("impl", IMPLS)
def test_filters_keep_what_the_sorted_rule_keeps(impl):
    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal((len(ROWS), 3, 1000))).astype(np.float32)
    got = _filter(x, ROWS, impl)
    for b, c in enumerate(ROWS):
        for r in range(3):
            _assert_same_kept(got[b, r], x[b, r], c, f"row {b}.{r}")
    assert [int(np.isfinite(got[b, 0]).sum()) for b in (1, 4)] == [5, 1]


@pytest.mark.parametrize("impl", IMPLS)
def test_filters_at_the_vocabulary_size_on_peaked_flat_and_tied_rows(impl):
    """49,152 logits a row: the native kernels' histogram buckets then hold
    thousands of members (flat rows), whole runs of equal values (rounded
    rows) and -inf entries (a row top-k filtered before top-p)."""
    rng = np.random.default_rng(1)
    v = 49152
    peaked = 6 * rng.standard_normal(v)
    flat = 0.3 * rng.standard_normal(v)
    tied = np.round(2 * rng.standard_normal(v)) / 2  # 20-odd distinct values
    holes = np.where(rng.random(v) < 0.5, -np.inf, 2 * rng.standard_normal(v))
    x = np.stack([peaked, flat, tied, holes, flat, tied, -peaked])[:, None].astype(np.float32)
    rows = [SamplingConfig(1.0, top_k=40, top_p=0.9), SamplingConfig(1.0, top_p=0.95),
            SamplingConfig(1.0, top_p=0.5), SamplingConfig(0.7, top_k=3000, top_p=0.8),
            SamplingConfig(1.0, top_k=20000), SamplingConfig(1.0, top_k=7), SamplingConfig(1.0, top_k=v - 1)]
    got = _filter(x, rows, impl)
    for b, c in enumerate(rows):
        _assert_same_kept(got[b, 0], x[b, 0], c, f"row {b}")
    assert 1 < np.isfinite(got[2, 0]).sum() < v  # the tied row's cut falls inside a run of ties


@pytest.mark.parametrize("impl", IMPLS)
def test_ties_at_a_boundary_are_kept_together(impl):
    x = np.asarray([[3.0, 2.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, -5.0]], np.float32)
    kept = np.isfinite(_filter(x, [SamplingConfig(1.0, top_k=2), SamplingConfig(1.0, top_p=0.3)], impl))
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
