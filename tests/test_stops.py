"""eagle_jax.stops with the SmolLM2 tokenizer: whole and incremental text agree, a stop string
cuts both at the same place, and no piece shows text a later token could still take back."""

import gzip
import itertools
import json
import os
import random

import pytest

from eagle_jax.stops import StreamText, cut_at_stop

TEXT = "def add(a, b):\n    return a + b\n\n# caf\u00e9 \U0001F600 done\nprint(add(1, 2))"


@pytest.fixture(scope="module")
def tok(smollm2_target):
    return smollm2_target.tokenizer


def _stream(tok, toks, stop):
    """Feed `toks` one token at a time, as decoding steps would; (pieces, text, tokens behind it)."""
    text = StreamText(tok, stop)
    pieces = []
    for n in range(1, len(toks) + 1):
        piece, _ = text.advance(toks[:n], final=n == len(toks))
        pieces.append(piece)
        if text.stopped:
            break
    return pieces, text


def test_no_stop_string_keeps_every_token(tok):
    toks = tok.encode(TEXT)
    kept, text, stopped = cut_at_stop(tok, toks, ["never there"])
    assert (kept, text, stopped) == (toks, tok.decode(toks, skip_special_tokens=True), False)


def test_a_stop_string_cuts_text_and_tokens_at_its_first_occurrence(tok):
    toks = tok.encode(TEXT)
    kept, text, stopped = cut_at_stop(tok, toks, ["return", "\n\n"])
    assert stopped and text == "def add(a, b):\n    "
    # the shortest token prefix whose text covers the kept text
    assert tok.decode(kept, skip_special_tokens=True).startswith(text)
    assert len(tok.decode(kept[:-1], skip_special_tokens=True)) < len(text)


@pytest.mark.parametrize("stop", [[], ["\n\n"], ["add(1"], ["\U0001F600"]])
def test_streamed_pieces_join_to_the_whole_text(tok, stop):
    toks = tok.encode(TEXT)
    pieces, text = _stream(tok, toks, stop)
    whole_toks, whole, stopped = cut_at_stop(tok, toks, stop)
    assert "".join(pieces) == whole and text.stopped == stopped
    assert text.tokens == len(whole_toks)
    for s in stop:  # nothing past the cut was ever shown
        assert s not in "".join(pieces)


def test_a_partial_character_is_held_back_until_complete(tok):
    toks = tok.encode("\U0001F600")
    assert len(toks) > 1  # the emoji's UTF-8 bytes span several byte-level tokens
    pieces, _ = _stream(tok, toks, [])
    assert pieces[:-1] == [""] * (len(toks) - 1) and pieces[-1] == "\U0001F600"


# ---------------------------------------------------------------------------- against the whole-list decode

SHAREGPT = os.path.join(os.path.dirname(__file__), "..", "train", "data", "sharegpt-regen.jsonl.gz")


def _real_texts(conversations: int = 1500, plain: int = 60) -> list[str]:
    """User turns and the target's answers of the first committed ShareGPT conversations: every one
    with a non-ASCII character (CJK, accents, emoji, ...) and the first `plain` others."""
    texts, ascii_only = [], []
    with gzip.open(SHAREGPT, "rt", encoding="utf-8") as f:
        for line in itertools.islice(f, conversations):
            for m in json.loads(line)["messages"][:2]:
                (texts if not m["content"].isascii() else ascii_only).append(m["content"])
    return texts + ascii_only[:plain]


def _reference(tok, toks, stop, holdback, final, shown):
    """What a stream must have shown once the row has `toks` (whole-list decode, `cut_at_stop`):
    (text, stopped, tokens behind it): all of it when stopped or final, else less the last
    `holdback` characters and any trailing replacement characters (a partial character
    may be one or several), never less than `shown`."""
    kept, text, stopped = cut_at_stop(tok, toks, stop)
    if not (stopped or final):
        settled = text.rstrip("\ufffd")
        text = settled[:max(len(settled) - holdback, len(shown))]
    return text, stopped, len(kept)


def _check_stream(tok, toks, stop, rng):
    """Feed `toks` a random 1..5 tokens at a time (a speculative step's accepted run); at every step
    the text shown must be what the whole-list decode of the tokens so far gives (a stop string
    that completes first ends the row, even if one that completes later starts before it), and
    the tokens behind it at the end."""
    st = StreamText(tok, stop)
    shown, n = "", 0
    while n < len(toks):
        n = min(n + rng.randint(1, 5), len(toks))
        final = n == len(toks)
        piece, _ = st.advance(toks[:n], final)
        ref, stopped, used = _reference(tok, toks[:n], stop, st.holdback, final, shown)
        shown += piece
        assert shown == ref and st.stopped == stopped, (toks[:n], stop, shown, ref)
        if stopped or final:
            assert st.tokens == used, (toks[:n], stop)
            return


def _stops_within(text: str, rng) -> list[str]:
    """0 to 3 stop strings cut from `text` at random (most straddle token boundaries) and one that
    never occurs (it holds text back)."""
    stops = []
    for _ in range(rng.randint(0, 3)):
        at = rng.randrange(max(len(text) // 3, 1), max(len(text), 2))
        stops.append(text[at:at + rng.randint(1, 8)])
    return stops + ["\x00never" * rng.randint(0, 1)]


def test_stream_equals_whole_decode_on_real_texts(tok):
    """Real text in many scripts (multi-byte characters split over byte-level tokens), stop strings
    cut out of it, a few special and added tokens put in: the stream shows at every step what the
    whole list's decode shows."""
    rng = random.Random(0)
    specials = tok.hf.all_special_ids + sorted(tok.hf.get_added_vocab().values())[:8]
    texts = _real_texts()
    assert sum(any(ord(c) > 0x2E80 for c in t) for t in texts) >= 20  # CJK among them
    for text in texts:
        toks = tok.encode(text, add_special_tokens=False)[:160]
        if rng.random() < 0.3:
            for _ in range(rng.randint(1, 3)):
                toks.insert(rng.randrange(len(toks) + 1), rng.choice(specials))
        _check_stream(tok, toks, _stops_within(tok.decode(toks, skip_special_tokens=True), rng), rng)


def test_stream_equals_whole_decode_on_random_tokens(tok):
    """Any token ids (lone UTF-8 bytes, invalid sequences, specials, leading spaces): the same."""
    rng = random.Random(1)
    byte_tokens = [tok.encode(c, add_special_tokens=False)[i] for c in ("\U0001F600", "\u00e9", "\u4e2d")
                   for i in range(len(tok.encode(c, add_special_tokens=False)))]
    for _ in range(1000):
        toks = [rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(tok.vocab_size)
                for _ in range(rng.randint(1, 60))]
        _check_stream(tok, toks, _stops_within(tok.decode(toks, skip_special_tokens=True), rng), rng)


class _Counting:
    """A tokenizer that counts the tokens each step passes to `decode`."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, skip_special_tokens=False):
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_step_decodes_a_few_tokens_however_long_the_row(tok):
    """A 4,096-token row (with multi-byte characters), three tokens a step, a stop string at its very
    end: each step decodes as many tokens at the end as at the start, the stop's step included."""
    unit = tok.encode(" caf\u00e9 \u4e2d\u6587 \U0001F600 done,", add_special_tokens=False)
    toks = (unit * (4096 // len(unit) + 1))[:4096] + tok.encode(" THE END", add_special_tokens=False)
    counting = _Counting(tok)
    st = StreamText(counting, ["THE END", "never there"])
    per_step, shown = [], ""
    for n in range(3, len(toks) + 3, 3):
        counting.decoded = 0
        shown += st.advance(toks[:n], final=n >= len(toks))[0]
        per_step.append(counting.decoded)
        if st.stopped:
            break
    assert st.stopped and shown == tok.decode(toks, skip_special_tokens=True).removesuffix("THE END")
    assert len(shown) > 4000
    first = max(per_step[:50])
    assert first <= 2 * 2 * (3 + len(unit))  # two decodes of a window of a step or two
    assert max(per_step[-50:-1]) <= first and per_step[-1] <= 3 * first, per_step  # [-1]: the stop's step
