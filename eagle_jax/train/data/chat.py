"""Rendering conversations with the chat template into ``input_ids`` and the
response-token ``loss_mask`` (the mask convention is in :mod:`eagle_jax.train.data`)."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np


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
