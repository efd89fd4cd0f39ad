"""Tests for eagle_jax.train.vocab: frequencies, d2t/t2d, coverage."""

from __future__ import annotations

import numpy as np
import pytest

from eagle_jax.train import vocab


def _brute(freqs, n, V):
    """Direct construction: rank every id by (-count, id), keep the first n,
    sort them, offsets = id - position."""
    counts = [int(freqs[t]) if t < len(freqs) else 0 for t in range(V)]
    ranked = sorted(range(V), key=lambda t: (-counts[t], t))
    kept = sorted(ranked[:n])
    d2t = [t - i for i, t in enumerate(kept)]
    t2d = [t in set(kept) for t in range(V)]
    return kept, d2t, t2d


@pytest.mark.parametrize("seed", range(6))
def test_build_draft_vocab_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    V = int(rng.integers(20, 300))
    n = int(rng.integers(1, V + 1))
    # few distinct values -> many ties; many zeros -> "fewer seen than n" cases
    freqs = rng.integers(0, 5, size=V) * (rng.random(V) < rng.uniform(0.05, 0.9))
    d2t, t2d = vocab.build_draft_vocab(freqs, n, V)
    kept, d2t_ref, t2d_ref = _brute(freqs, n, V)
    assert d2t.dtype == np.int64 and d2t.shape == (n,)
    assert t2d.dtype == np.bool_ and t2d.shape == (V,)
    assert d2t.tolist() == d2t_ref
    assert t2d.tolist() == t2d_ref
    target = vocab.draft_to_target_ids(d2t)
    assert target.tolist() == kept
    assert (np.diff(target) > 0).all()
    assert np.flatnonzero(t2d).tolist() == kept
    # the scatter used at verification time lands on exactly the kept ids
    full = np.full(V, -np.inf)
    full[np.arange(n) + d2t] = 0.0
    assert np.isfinite(full).tolist() == t2d.tolist()


def test_build_draft_vocab_hand_example():
    freqs = np.array([0, 5, 1, 5, 0, 9, 2, 0])
    d2t, t2d = vocab.build_draft_vocab(freqs, 3, 8)
    # top 3 by count: 5 (9), then 1 and 3 (5, tie by lower id) -> sorted [1, 3, 5]
    assert d2t.tolist() == [1, 2, 3]
    assert np.flatnonzero(t2d).tolist() == [1, 3, 5]
    # tie at the cut (ids 1 and 3 both 5): the lower id wins
    d2t, t2d = vocab.build_draft_vocab(freqs, 2, 8)
    assert np.flatnonzero(t2d).tolist() == [1, 5] and d2t.tolist() == [1, 4]
    d2t, t2d = vocab.build_draft_vocab(freqs, 4, 8)
    assert np.flatnonzero(t2d).tolist() == [1, 3, 5, 6]
    # fewer seen (5 distinct) than asked (7): fill with the lowest unseen ids 0, 4
    d2t, t2d = vocab.build_draft_vocab(freqs, 7, 8)
    assert np.flatnonzero(t2d).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert d2t.tolist() == [0] * 7
    # full vocab: identity
    d2t, t2d = vocab.build_draft_vocab(freqs, 8, 8)
    assert d2t.tolist() == [0] * 8 and t2d.all()


@pytest.mark.parametrize("seed", range(6))
def test_widen_draft_vocab_matches_brute_force(seed):
    """The old ids stay; the most frequent others (ties: lower id) fill the rest; sorted as build's."""
    rng = np.random.default_rng(100 + seed)
    V = int(rng.integers(20, 300))
    old = np.sort(rng.choice(V, int(rng.integers(1, V // 2)), replace=False))
    n = int(rng.integers(len(old), V + 1))
    freqs = rng.integers(0, 5, size=V) * (rng.random(V) < rng.uniform(0.05, 0.9))
    d2t, t2d = vocab.widen_draft_vocab(old - np.arange(len(old)), freqs, n, V)
    others = sorted((t for t in range(V) if t not in set(old.tolist())), key=lambda t: (-int(freqs[t]), t))
    kept = sorted(old.tolist() + others[: n - len(old)])
    assert vocab.draft_to_target_ids(d2t).tolist() == kept
    assert np.flatnonzero(t2d).tolist() == kept and d2t.dtype == np.int64
    # widening to its own size changes nothing; build's vocabulary widened by build's order is build's
    same = vocab.widen_draft_vocab(old - np.arange(len(old)), freqs, len(old), V)
    assert vocab.draft_to_target_ids(same[0]).tolist() == old.tolist()
    small = vocab.build_draft_vocab(freqs, len(old), V)
    np.testing.assert_array_equal(vocab.widen_draft_vocab(small[0], freqs, n, V)[1],
                                  vocab.build_draft_vocab(freqs, n, V)[1])
    with pytest.raises(ValueError, match="widened"):
        vocab.widen_draft_vocab(old - np.arange(len(old)), freqs, len(old) - 1, V)


def test_build_draft_vocab_inputs():
    # a dict, a short array and a padded array agree
    a = vocab.build_draft_vocab({3: 4, 1: 2, 7: 1}, 2, 10)
    b = vocab.build_draft_vocab(np.array([0, 2, 0, 4]), 2, 10)
    c = vocab.build_draft_vocab(np.array([0, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0]), 2, 10)
    for x in (b, c):
        assert a[0].tolist() == x[0].tolist() and a[1].tolist() == x[1].tolist()
    with pytest.raises(ValueError):
        vocab.build_draft_vocab(np.ones(12), 2, 10)  # counts beyond the target vocab
    with pytest.raises(ValueError):
        vocab.build_draft_vocab(np.ones(10), 11, 10)
    with pytest.raises(ValueError):
        vocab.build_draft_vocab(np.ones(10), 0, 10)
    with pytest.raises(ValueError):
        vocab.build_draft_vocab({12: 1}, 2, 10)


def test_token_frequencies_counts_only_response_tokens():
    exs = [
        {"input_ids": np.array([1, 5, 5, 7, 2], np.int32), "loss_mask": np.array([0, 1, 1, 0, 1], np.int32)},
        {"input_ids": np.array([7, 7, 3], np.int32), "loss_mask": np.array([1, 0, 0], np.int32)},
        (np.array([9, 5]), np.array([0, 1])),
        {"input_ids": np.array([4], np.int32), "loss_mask": np.array([0], np.int32)},
    ]
    f = vocab.token_frequencies(exs, vocab_size=12)
    assert f.dtype == np.int64 and f.shape == (12,)
    want = np.zeros(12, np.int64)
    want[5] = 3
    want[2] = 1
    want[7] = 1
    assert f.tolist() == want.tolist()
    g = vocab.token_frequencies(exs)  # length = largest counted id + 1
    assert g.tolist() == want[:8].tolist()
    with pytest.raises(ValueError):
        vocab.token_frequencies(exs, vocab_size=6)
    assert vocab.token_frequencies([], vocab_size=4).tolist() == [0, 0, 0, 0]


def test_coverage():
    freqs = np.array([10, 0, 5, 3, 2])
    t2d = np.array([True, True, False, True, False])
    assert vocab.coverage(freqs, t2d) == pytest.approx(13 / 20)
    assert vocab.coverage(freqs, np.ones(5, bool)) == 1.0
    assert vocab.coverage(np.zeros(5), t2d) == 0.0
    # top-n vocab has the best possible coverage for its size
    rng = np.random.default_rng(0)
    f = rng.integers(0, 100, size=200)
    d2t, t2d = vocab.build_draft_vocab(f, 50, 200)
    best = np.sort(f)[::-1][:50].sum() / f.sum()
    assert vocab.coverage(f, t2d) == pytest.approx(best)
    for _ in range(20):
        other = np.zeros(200, bool)
        other[rng.choice(200, 50, replace=False)] = True
        assert vocab.coverage(f, other) <= vocab.coverage(f, t2d) + 1e-12


def test_draft_vocab_on_real_responses(tokenizer, sharegpt_file):
    from eagle_jax.train import data

    convs = list(data.iter_sharegpt(limit=60))
    exs = data.tokenize_conversations(convs, tokenizer, max_length=1024)
    V = len(tokenizer)
    f = vocab.token_frequencies(exs, vocab_size=V)
    assert f.sum() == sum(int(e["loss_mask"].sum()) for e in exs)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert f[im_end] > 0 and f[im_start] == 0  # end-of-turn is a response token
    d2t, t2d = vocab.build_draft_vocab(f, 2048, V)
    assert t2d.sum() == 2048 and t2d[im_end]
    cov = vocab.coverage(f, t2d)
    assert 0.8 < cov < 1.0
