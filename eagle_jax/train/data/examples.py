"""The tokenized-examples cache: one ``.npz`` per data source, reused while
its metadata (format, lengths, tokenizer fingerprint) matches."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from eagle_jax.train.data.chat import tokenize_conversations


CACHE_FORMAT = 1


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of what decides the token ids: the chat template and the whole fast
    tokenizer (vocabulary, merges, pre-tokenizer, special tokens: its `tokenizers` JSON),
    else the vocabulary."""
    h = hashlib.sha1()
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        vocab = tokenizer.get_vocab()
        h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode())
    return h.hexdigest()[:16]


def save_examples(path: str | os.PathLike, examples: Sequence[Mapping], meta: Mapping | None = None) -> None:
    """Save examples to one ``.npz``: flat ``input_ids`` int32, ``loss_mask``
    uint8, ``offsets`` int64 [N+1], ``ids`` (str) and ``meta`` (JSON).
    Written to a temporary file and renamed, so a crash leaves no half cache."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lens = np.array([len(ex["input_ids"]) for ex in examples], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    flat_ids = (
        np.concatenate([np.asarray(ex["input_ids"], np.int32) for ex in examples])
        if examples else np.zeros(0, np.int32)
    )
    flat_mask = (
        np.concatenate([np.asarray(ex["loss_mask"], np.uint8) for ex in examples])
        if examples else np.zeros(0, np.uint8)
    )
    ids = np.array([str(ex.get("id", "")) for ex in examples], dtype=np.str_)
    m = dict(meta or {})
    m["format"] = CACHE_FORMAT
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(
        tmp,
        input_ids=flat_ids,
        loss_mask=flat_mask,
        offsets=offsets,
        ids=ids,
        meta=np.array(json.dumps(m, sort_keys=True)),
    )
    os.replace(tmp, path)


def load_examples(path: str | os.PathLike) -> tuple[list[dict], dict]:
    """Load ``(examples, meta)`` written by :func:`save_examples`.  The
    examples' arrays are views into two flat arrays (int32 ids and mask)."""
    with np.load(path, allow_pickle=False) as z:
        flat_ids = z["input_ids"].astype(np.int32, copy=False)
        flat_mask = z["loss_mask"].astype(np.int32)
        offsets = z["offsets"]
        ids = z["ids"]
        meta = json.loads(str(z["meta"]))
    examples = [
        {
            "id": str(ids[k]),
            "input_ids": flat_ids[offsets[k] : offsets[k + 1]],
            "loss_mask": flat_mask[offsets[k] : offsets[k + 1]],
        }
        for k in range(len(ids))
    ]
    return examples, meta


def load_or_build_cache(
    path: str | os.PathLike,
    convs: Iterable[Mapping] | Callable[[], Iterable[Mapping]],
    tokenizer,
    max_length: int | None,
    *,
    limit: int | None = None,
    meta: Mapping | None = None,
    rebuild: bool = False,
) -> list[dict]:
    """Tokenize conversations once and reuse the ``.npz`` afterwards.

    The cache is reused only if its metadata matches: format version,
    ``max_length``, ``limit``, the tokenizer fingerprint and any extra
    ``meta`` the caller passes (e.g. a data source name or split); otherwise
    it is rebuilt.  ``convs`` may be a callable so that nothing is read when
    the cache is valid.
    """
    want = dict(meta or {})
    want.update(
        format=CACHE_FORMAT,
        max_length=max_length,
        limit=limit,
        tokenizer=tokenizer_fingerprint(tokenizer),
    )
    want = json.loads(json.dumps(want, sort_keys=True))
    path = Path(path)
    if path.is_file() and not rebuild:
        try:
            examples, have = load_examples(path)
        except Exception:
            have = None
        if have is not None and all(have.get(k) == v for k, v in want.items()):
            return examples
    src = convs() if callable(convs) else convs
    examples = tokenize_conversations(src, tokenizer, max_length, limit=limit)
    save_examples(path, examples, want)
    return examples
