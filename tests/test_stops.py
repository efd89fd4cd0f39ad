"""eagle_jax.stops with the SmolLM2 tokenizer: whole and incremental text agree, a stop string
cuts both at the same place, and no piece shows text a later token could still take back."""

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
