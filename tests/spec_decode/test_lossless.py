"""Speculative sampling is lossless: its output distribution is the target's, with
either sampler (spec_decode/sampling.py: rejection sampling, and the coupled
Gumbel-max sampler).

The exact distribution of the first three generated tokens is enumerated from
the target (vocabulary 8 -> 512 sequences) and compared with thousands of
samples (one seed stream a row) by a chi-square test. The same test must
reject each sampler broken: rejection sampling accepting every draft, the
coupled sampler drawing every position's noise from one key.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from eagle_jax.config import SamplingConfig, SpecConfig
from eagle_jax.engine.batch import run_batch
from eagle_jax.generate import Generator, PromptError
from eagle_jax.models import target
from eagle_jax.spec_decode import sampling
from eagle_jax.spec_decode.sampling import SamplingParams, probabilities
from eagle_jax.spec_decode.stats import summarize

from spec_helpers import random_prompts, tiny_drafter, tiny_target

SAMPLING = SamplingConfig(temperature=0.9, top_k=6, top_p=0.95)
N_SAMPLES = 6000


def exact_distribution(tcfg, tparams, prompt, sampling, n_tokens=3):
    """P(y1..yn | prompt) for every sequence, by direct target forwards."""
    v = tcfg.vocab_size
    seqs = np.array(list(itertools.product(range(v), repeat=n_tokens)), np.int32)
    full = np.concatenate([np.tile(np.asarray(prompt, np.int32), (len(seqs), 1)), seqs], 1)
    t = full.shape[1]
    cache = target.create_cache(tcfg, len(seqs), t)
    pos = jnp.broadcast_to(jnp.arange(t), full.shape)
    model = target.Target(tcfg, tparams)
    hidden, _, _ = model(jnp.asarray(full), pos, cache)
    probs = np.asarray(probabilities(model.logits(hidden), SamplingParams.rows([sampling] * len(seqs))))
    p0 = len(prompt) - 1
    out = np.ones(len(seqs))
    for i in range(n_tokens):
        out *= probs[np.arange(len(seqs)), p0 + i, seqs[:, i]]
    return seqs, out


def chi_square_pvalue(samples, seqs, expected_p):
    index = {tuple(s): i for i, s in enumerate(seqs.tolist())}
    counts = np.zeros(len(seqs))
    for s in samples:
        counts[index[tuple(s)]] += 1
    expected = expected_p * len(samples)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def speculative_samples(gen, prompt, coupled: bool, seed=0):
    """(the first 3 tokens [N_SAMPLES, 3] of N_SAMPLES rows, row r on stream r of `seed`; accepted drafts)."""
    rows = gen.requests(N_SAMPLES, max_new_tokens=3, temperature=SAMPLING.temperature, top_k=SAMPLING.top_k,
                        top_p=SAMPLING.top_p, seed=seed)
    out = run_batch(gen, [prompt] * N_SAMPLES, [dataclasses.replace(r, coupled=coupled) for r in rows])
    assert (out.num_generated == 3).all()
    return out.tokens[:, :3], summarize(out.stats)["accepted_tokens"] if out.stats is not None else 0


@pytest.fixture(scope="module")
def setup():
    tcfg, tparams = tiny_target(vocab=8, seed=5, scale=0.25)
    prompt = random_prompts(8, [6], seed=9)[0]
    seqs, p = exact_distribution(tcfg, tparams, prompt, SAMPLING)
    assert abs(p.sum() - 1) < 1e-4
    return tcfg, tparams, prompt, seqs, p


SAMPLERS = pytest.mark.parametrize("coupled", [False, True], ids=["rejection", "coupled"])


@SAMPLERS
@pytest.mark.parametrize("spec", [SpecConfig("chain", num_speculative_tokens=3),
                                  SpecConfig("tree", tree_top_k=3, tree_depth=3, tree_total_tokens=10)],
                         ids=["chain", "tree"])
def test_speculative_sampling_matches_target(setup, spec, coupled):
    """Rejection: a chain's min(1, p/q), a tree's sibling rule; coupled: drafts equal to the race."""
    tcfg, tparams, prompt, seqs, p = setup
    gen = Generator(tcfg, tparams, drafter=tiny_drafter(tcfg, "eagle3.1", draft_vocab=6), spec=spec)
    tokens, accepted = speculative_samples(gen, prompt, coupled)
    assert accepted > N_SAMPLES // 10  # drafts are accepted, so the rule is exercised
    assert chi_square_pvalue(tokens, seqs, p) > 1e-3


@SAMPLERS
def test_plain_sampling_matches_target(setup, coupled):
    tcfg, tparams, prompt, seqs, p = setup
    tokens, _ = speculative_samples(Generator(tcfg, tparams), prompt, coupled)
    assert chi_square_pvalue(tokens, seqs, p) > 1e-3


def _broken_samples(setup, monkeypatch, module, name, broken, coupled):
    """speculative_samples (chain) with module.name replaced by broken(original)."""
    tcfg, tparams, prompt, _, _ = setup
    gen = Generator(tcfg, tparams, drafter=tiny_drafter(tcfg, "eagle3.1", draft_vocab=6),
                    spec=SpecConfig("chain", num_speculative_tokens=3))
    jax.clear_caches()
    monkeypatch.setattr(module, name, broken(getattr(module, name)))
    try:
        return speculative_samples(gen, prompt, coupled)[0]
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def test_broken_acceptance_rule_is_detected(setup, monkeypatch):
    """Rejection sampling accepting every draft (u = 0) skews the distribution; the test must see it."""
    _, _, _, seqs, p = setup
    tokens = _broken_samples(setup, monkeypatch, jax.random, "uniform",
                             lambda _: lambda key, shape, *a, **k: jnp.zeros(shape), coupled=False)
    assert chi_square_pvalue(tokens, seqs, p) < 1e-6


def test_noise_shared_between_positions_is_detected(setup, monkeypatch):
    """The coupled sampler with one noise for every position of a row (each token alone is still
    an exact draw, but they are no longer independent): the test must see it."""
    _, _, _, seqs, p = setup
    tokens = _broken_samples(setup, monkeypatch, sampling, "position_keys",
                             lambda keys_at: lambda keys, positions: keys_at(keys, positions * 0), coupled=True)
    assert chi_square_pvalue(tokens, seqs, p) < 1e-6


def test_same_seed_same_output(setup):
    tcfg, tparams, prompt, _, _ = setup
    gen = Generator(tcfg, tparams, drafter=tiny_drafter(tcfg, "eagle3", draft_vocab=6),
                    spec=SpecConfig("tree", tree_top_k=2, tree_depth=3, tree_total_tokens=6))
    kw = dict(max_new_tokens=12, temperature=0.8, seed=123)
    a = gen.generate([prompt] * 4, **kw).token_ids
    assert a == gen.generate([prompt] * 4, **kw).token_ids
    assert a != gen.generate([prompt] * 4, **{**kw, "seed": 124}).token_ids


@pytest.mark.parametrize("spec", [None, SpecConfig("chain", num_speculative_tokens=3),
                                  SpecConfig("tree", tree_top_k=2, tree_depth=3, tree_total_tokens=6)],
                         ids=["plain", "chain", "tree"])
def test_seeded_row_samples_the_same_alone_and_in_a_batch(setup, spec):
    """Randomness is per row: a request seeded s draws the same tokens whatever shares its batch."""
    tcfg, tparams, prompt, _, _ = setup
    drafter = tiny_drafter(tcfg, "eagle3.1", draft_vocab=6) if spec else None
    gen = Generator(tcfg, tparams, drafter=drafter, spec=spec or SpecConfig())
    others = random_prompts(8, [3, 9], seed=4)
    kw = dict(max_new_tokens=12, temperature=0.8)
    alone = gen.generate([prompt], seed=[77], **kw).token_ids[0]
    assert alone == gen.generate([prompt], seed=77, **kw).token_ids[0]  # one int = stream 0 of it
    batched = gen.generate([others[0], prompt, others[1]], seed=[5, 77, 6], **kw).token_ids
    assert batched[1] == alone
    assert batched[0] != batched[2] or others[0] == others[1]
    # One int seed for a batch: rows draw from different streams, and row r's is the pair (seed, r).
    same = gen.generate([prompt] * 4, seed=77, **kw).token_ids
    assert len({tuple(t) for t in same}) > 1
    assert gen.generate([others[0], prompt], seed=[4, (77, 2)], **kw).token_ids[1] == same[2]


def test_bad_seeds_are_rejected(setup):
    tcfg, tparams, prompt, _, _ = setup
    gen = Generator(tcfg, tparams)
    for seed, msg in [([1, 2], "one per prompt"), (-1, r"\[0, 2\*\*31\)"), (1.5, "seed must be"),
                      ([(1, 2, 3)], "pair"), ([(1, -2)], "pair")]:
        with pytest.raises(PromptError, match=msg):
            gen.generate([prompt], seed=seed, max_new_tokens=2, temperature=0.8)
