"""The fixed held-out split: membership is a keyed hash of the original
conversation id, so it never depends on how much was read or in which order."""

from __future__ import annotations

import hashlib
import re
from typing import Iterable


_CHUNK_SUFFIX = re.compile(r"_\d+$")
_TURN_SUFFIX = re.compile(r"#u\d+$")


def base_id(conv_id: str) -> str:
    """ShareGPT's split file cuts long conversations into chunks
    ``<id>_0, <id>_1, ...``, and `regenerate --later-turns` names a later turn
    ``<chunk id>#u<j>``; the split keys on ``<id>`` so that all chunks and turns of
    one original conversation land on the same side."""
    return _CHUNK_SUFFIX.sub("", _TURN_SUFFIX.sub("", conv_id))


def _unit_hash(key: str, seed: int) -> float:
    h = hashlib.blake2b(f"{seed}:{key}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def is_heldout(conv_id: str, heldout_fraction: float = 0.02, seed: int = 0) -> bool:
    """True if the conversation belongs to the held-out split.

    A pure function of ``(base_id(conv_id), seed)``: a keyed hash mapped to
    [0, 1) compared with ``heldout_fraction``.  So membership never depends
    on how many conversations were read or in which order, and the held-out
    set for a larger fraction contains the one for a smaller fraction.
    """
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    return _unit_hash(base_id(conv_id), seed) < heldout_fraction


def split_conversations(
    convs: Iterable[dict],
    heldout_fraction: float = 0.02,
    seed: int = 0,
    *,
    max_heldout: int | None = None,
) -> tuple[list[dict], list[dict]]:
    """Split conversations into ``(train, heldout)`` by :func:`is_heldout`.

    Both lists keep input order.  ``max_heldout`` keeps only the first that
    many held-out conversations (in input order) for evaluation; the rest of
    the held-out side is discarded, never moved to train, so the training
    set is the same whatever ``max_heldout`` is.
    """
    train: list[dict] = []
    held: list[dict] = []
    for c in convs:
        if is_heldout(str(c["id"]), heldout_fraction, seed):
            if max_heldout is None or len(held) < max_heldout:
                held.append(c)
        else:
            train.append(c)
    return train, held
