"""Draft vocabulary (EAGLE.md section 3): the most frequent response tokens.

``d2t`` (int64 ``[Vd]``) holds offsets, ``target_id = draft_id + d2t[draft_id]``;
``t2d`` (bool ``[V]``) marks the target ids present in the draft vocabulary.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

__all__ = [
    "token_frequencies",
    "build_draft_vocab",
    "widen_draft_vocab",
    "draft_to_target_ids",
    "coverage",
]


def token_frequencies(examples: Iterable[Mapping], vocab_size: int | None = None) -> np.ndarray:
    """Count token ids over response tokens only (``loss_mask == 1``).

    ``examples``: dicts with ``input_ids`` and ``loss_mask`` (as made by
    ``eagle_jax.train.data.render``), or ``(input_ids, loss_mask)`` pairs.
    Returns int64 counts of length ``vocab_size`` (default: largest id seen
    + 1); an id >= ``vocab_size`` is an error.
    """
    counts = np.zeros(vocab_size or 0, np.int64)
    pending: list[np.ndarray] = []
    n_pending = 0

    def flush() -> None:
        nonlocal counts, pending, n_pending
        if not pending:
            return
        sel = np.concatenate(pending)
        pending, n_pending = [], 0
        if sel.min() < 0:
            raise ValueError("negative token id")
        top = int(sel.max()) + 1
        if top > len(counts):
            if vocab_size is not None:
                raise ValueError(f"token id {top - 1} >= vocab_size {vocab_size}")
            counts = np.concatenate([counts, np.zeros(top - len(counts), np.int64)])
        counts += np.bincount(sel, minlength=len(counts))

    for ex in examples:
        if isinstance(ex, Mapping):
            ids, mask = ex["input_ids"], ex["loss_mask"]
        else:
            ids, mask = ex
        ids = np.asarray(ids)
        mask = np.asarray(mask)
        if ids.shape != mask.shape:
            raise ValueError(f"input_ids {ids.shape} and loss_mask {mask.shape} differ")
        sel = ids[mask.astype(bool)].astype(np.int64)
        if sel.size:
            pending.append(sel)
            n_pending += sel.size
            if n_pending >= 1 << 22:
                flush()
    flush()
    return counts


def _as_counts(freqs, target_vocab_size: int) -> np.ndarray:
    if isinstance(freqs, Mapping):
        counts = np.zeros(target_vocab_size, np.int64)
        for t, c in freqs.items():
            t = int(t)
            if not 0 <= t < target_vocab_size:
                raise ValueError(f"token id {t} outside target vocab of {target_vocab_size}")
            counts[t] += int(c)
        return counts
    counts = np.asarray(freqs)
    if counts.ndim != 1:
        raise ValueError("freqs must be 1-D")
    if len(counts) > target_vocab_size:
        if counts[target_vocab_size:].any():
            raise ValueError("freqs count token ids outside the target vocab")
        counts = counts[:target_vocab_size]
    out = np.zeros(target_vocab_size, np.int64)
    out[: len(counts)] = counts
    return out


def build_draft_vocab(
    freqs, draft_vocab_size: int, target_vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Build ``(d2t int64 [draft_vocab_size], t2d bool [target_vocab_size])``.

    ``freqs``: counts per target id (an array, as from
    :func:`token_frequencies`, shorter arrays are zero-padded) or a mapping
    ``{token_id: count}``.  Keeps the ``draft_vocab_size`` ids with the
    highest counts, ties broken by the lower id; if fewer distinct ids were
    seen, the lowest unseen ids fill the rest, so the size is exact.  The
    kept ids are sorted ascending: draft id ``i`` is the ``i``-th smallest
    kept target id ``target_id[i]``; ``d2t[i] = target_id[i] - i`` and
    ``t2d[target_id] = True``.
    """
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(
            f"need 0 < draft_vocab_size ({draft_vocab_size}) <= target_vocab_size ({target_vocab_size})"
        )
    order = _by_frequency(_as_counts(freqs, target_vocab_size))
    return _from_target_ids(order[:draft_vocab_size], target_vocab_size)


def widen_draft_vocab(
    d2t, freqs, draft_vocab_size: int, target_vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """A larger vocabulary holding every id of ``d2t``'s: ``(d2t, t2d)`` as
    :func:`build_draft_vocab` returns them.

    The ids of ``d2t`` stay; the ``draft_vocab_size - len(d2t)`` most frequent
    ids outside it (by ``freqs``, ties broken by the lower id) are added, and
    all are sorted ascending.  A trained drafter widened this way keeps every
    column of its head (``eagle_jax.train.initialize.widen_lm_head``).
    """
    old = draft_to_target_ids(d2t)
    if not len(old) <= draft_vocab_size <= target_vocab_size:
        raise ValueError(f"need {len(old)} (the vocabulary widened) <= draft_vocab_size ({draft_vocab_size}) "
                         f"<= target_vocab_size ({target_vocab_size})")
    if len(old) and (old.min() < 0 or old.max() >= target_vocab_size):
        raise ValueError(f"d2t maps outside the target vocab of {target_vocab_size}")
    order = _by_frequency(_as_counts(freqs, target_vocab_size))
    added = order[~np.isin(order, old)][: draft_vocab_size - len(old)]
    return _from_target_ids(np.concatenate([old, added]), target_vocab_size)


def _by_frequency(counts: np.ndarray) -> np.ndarray:
    """Every id, by count descending, then id ascending."""
    if (counts < 0).any():
        raise ValueError("negative frequency")
    return np.lexsort((np.arange(len(counts), dtype=np.int64), -counts))  # last key is primary


def _from_target_ids(ids, target_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    target_ids = np.sort(np.asarray(ids, np.int64))
    d2t = target_ids - np.arange(len(target_ids), dtype=np.int64)
    t2d = np.zeros(target_vocab_size, dtype=bool)
    t2d[target_ids] = True
    return d2t, t2d


def draft_to_target_ids(d2t: np.ndarray) -> np.ndarray:
    """The target id of every draft id: ``arange(Vd) + d2t``."""
    d2t = np.asarray(d2t, np.int64)
    return np.arange(len(d2t), dtype=np.int64) + d2t


def coverage(freqs, t2d: np.ndarray) -> float:
    """Fraction of the counted response tokens whose id is in the draft vocab
    (``t2d`` True).  0.0 when nothing was counted."""
    t2d = np.asarray(t2d, dtype=bool)
    counts = _as_counts(freqs, len(t2d))
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0
