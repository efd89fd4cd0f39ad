"""Fixed-shape training batches: bucketed by length, right-padded,
deterministic in ``(seed, epoch)`` and resumable from a batch cursor."""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import numpy as np


def num_batches(n_examples: int, batch_size: int, drop_last: bool = True) -> int:
    """Batches per epoch."""
    return n_examples // batch_size if drop_last else -(-n_examples // batch_size)


def batch_plan(
    lengths: Sequence[int] | np.ndarray,
    batch_size: int,
    seed: int = 0,
    epoch: int = 0,
    *,
    shuffle: bool = True,
    bucket_factor: int = 32,
    drop_last: bool = True,
) -> list[np.ndarray]:
    """The batches of one epoch as arrays of example indices.

    With ``shuffle``: permute all examples with ``Generator(PCG64([seed,
    epoch]))``, cut the permutation into windows of ``batch_size *
    bucket_factor``, sort each window by length (stable), cut it into
    batches (so rows of a batch have similar lengths and padding is small),
    then permute the batch order.  With ``drop_last`` the last
    ``n % batch_size`` examples of the permutation are left out of the epoch
    (a different few each epoch); otherwise the last batch is short (padded
    with empty rows by :func:`collate`).  Every epoch has exactly
    :func:`num_batches` batches.
    """
    lengths = np.asarray(lengths)
    n = len(lengths)
    if batch_size <= 0:
        raise ValueError("batch_size must be positive")
    if shuffle:
        rng = np.random.Generator(np.random.PCG64([seed, epoch]))
        order = rng.permutation(n)
    else:
        order = np.arange(n)
    if drop_last:
        order = order[: (n // batch_size) * batch_size]
    if shuffle and bucket_factor > 1:
        win = batch_size * bucket_factor
        parts = []
        for s in range(0, len(order), win):
            w = order[s : s + win]
            parts.append(w[np.argsort(lengths[w], kind="stable")])
        order = np.concatenate(parts) if parts else order
    plan = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    if shuffle:
        plan = [plan[i] for i in rng.permutation(len(plan))]
    return plan


def collate(
    examples: Sequence[Mapping],
    batch_size: int,
    seq_len: int,
    *,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Stack examples into right-padded fixed-shape arrays.

    Returns ``input_ids`` int32 [B, T] (``pad_id`` after the end),
    ``loss_mask`` int32 [B, T] (0 on padding), ``attention_mask`` int32
    [B, T] (1 on real tokens) and ``lengths`` int32 [B].  Examples longer
    than ``seq_len`` are truncated; missing rows (a short last batch) are
    all padding with length 0.
    """
    if len(examples) > batch_size:
        raise ValueError(f"{len(examples)} examples for batch_size {batch_size}")
    input_ids = np.full((batch_size, seq_len), pad_id, np.int32)
    loss_mask = np.zeros((batch_size, seq_len), np.int32)
    lengths = np.zeros((batch_size,), np.int32)
    for r, ex in enumerate(examples):
        ids = np.asarray(ex["input_ids"])[:seq_len]
        n = len(ids)
        input_ids[r, :n] = ids
        loss_mask[r, :n] = np.asarray(ex["loss_mask"])[:n]
        lengths[r] = n
    attention_mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.int32)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
        "lengths": lengths,
    }


def batches(
    examples: Sequence[Mapping],
    batch_size: int,
    seq_len: int,
    *,
    seed: int = 0,
    start: int = 0,
    epochs: int | None = 1,
    shuffle: bool = True,
    bucket_factor: int = 32,
    drop_last: bool = True,
    pad_id: int = 0,
    bucket_lengths: Sequence[int] | None = None,
    rows: slice | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Yield fixed-shape batches (see :func:`collate`) over ``epochs`` epochs
    (None: forever).

    ``start`` is an integer data cursor: the global index of the first batch
    to yield, counted across epochs.  ``batches(..., start=i)`` yields exactly
    the batches ``list(batches(..., start=0))[i:]`` would, without building
    the skipped ones, so a trainer resumes by saving ``start + steps_done``.
    The order depends only on ``seed``, the example lengths and the other
    arguments.

    ``bucket_lengths`` (optional, ascending, last <= ``seq_len``): pad each
    batch only to the smallest bucket length holding its longest row (or
    ``seq_len``), bounding the number of distinct shapes a jitted step sees.
    Every batch carries ``"epoch"`` and ``"index"`` (its global cursor) as
    Python ints, ``"real_tokens"`` (the whole batch's unpadded tokens) and
    ``"example_indices"`` [B] (positions in ``examples``, -1 for empty rows).

    ``rows``: only these rows of each batch are built (one process of a
    multi-process run: the rows its devices hold); the plan, the padded width
    and ``real_tokens`` are the whole batch's, so every process agrees on them.
    """
    lengths = np.array([min(len(ex["input_ids"]), seq_len) for ex in examples], np.int64)
    per_epoch = num_batches(len(examples), batch_size, drop_last)
    if per_epoch == 0:
        return
    if start < 0:
        raise ValueError("start must be >= 0")
    buckets = sorted(int(b) for b in bucket_lengths) if bucket_lengths else []
    if buckets and buckets[-1] > seq_len:
        raise ValueError("bucket_lengths must not exceed seq_len")
    epoch, i = divmod(start, per_epoch)
    while epochs is None or epoch < epochs:
        plan = batch_plan(
            lengths, batch_size, seed, epoch,
            shuffle=shuffle, bucket_factor=bucket_factor, drop_last=drop_last,
        )
        for j in range(i, per_epoch):
            idx = plan[j]
            width = seq_len
            if buckets:
                longest = int(lengths[idx].max()) if len(idx) else 0
                width = next((b for b in buckets if b >= longest), seq_len)
            full = np.concatenate([idx, -np.ones(batch_size - len(idx), np.int64)])
            mine = full[rows] if rows is not None else full
            b = collate([examples[k] for k in mine if k >= 0], len(mine), width, pad_id=pad_id)
            b["example_indices"] = mine
            b["real_tokens"] = int(lengths[idx].sum())
            b["epoch"] = epoch
            b["index"] = epoch * per_epoch + j
            yield b
        epoch += 1
        i = 0
