"""A row's text, cut at the first stop string: whole (`cut_at_stop`) or piece by piece (`StreamText`).

Every driver ends a reply at a stop string the same way through this module:
`Generator.generate` and `Generator.stream` (eagle_jax/generate.py) and the
engine (eagle_jax/engine/). The tokens kept are the shortest prefix whose
text covers the text kept, as vLLM reports them.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["cut_at_stop", "StreamText"]


def cut_at_stop(tokenizer, toks: list[int], stop: Sequence[str]) -> tuple[list[int], str, bool]:
    """(tokens, text, stopped): `toks` decoded and cut before the first stop string, with
    the shortest token prefix whose text covers what is kept (`toks` itself when none occurs)."""
    text = tokenizer.decode(toks, skip_special_tokens=True)
    hits = [text.find(s) for s in stop if s and s in text]
    if not hits:
        return toks, text, False
    text = text[:min(hits)]
    n = next(i for i in range(len(toks) + 1)
             if len(tokenizer.decode(toks[:i], skip_special_tokens=True)) >= len(text))
    return toks[:n], text, True


class StreamText:
    """Incremental text of one row: each call gives the text that is new and final,
    holding back what could still start a stop string or ends in a partial UTF-8
    character (until the row ends); `stopped` once a stop string has cut it."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.shown = ""
        self.tokens = 0  # tokens behind the text shown
        self.stopped = False

    def advance(self, toks: list[int], final: bool) -> tuple[str, int]:
        """(new text, tokens behind it) once the row has generated `toks`; `final`: it has ended."""
        toks, text, stopped = cut_at_stop(self.tok, toks, self.stop)
        self.stopped = self.stopped or stopped
        if not (final or self.stopped):
            if self.holdback:
                text = text[:max(len(text) - self.holdback, len(self.shown))]
            if text.endswith("\ufffd"):
                return "", 0
        piece, before = text[len(self.shown):], self.tokens
        self.shown, self.tokens = text, len(toks)
        return piece, self.tokens - before
