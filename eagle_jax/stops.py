"""A row's text, cut at the first stop string: whole (`cut_at_stop`) or piece by piece (`StreamText`).

Every driver ends a reply at a stop string the same way through this module:
`Generator.generate` (eagle_jax/generate.py: the whole list, once) and the
engine (eagle_jax/engine/, and `Generator.stream` through it: a step at a
time). The tokens kept are the shortest prefix whose text covers the text
kept, as vLLM reports them.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

__all__ = ["cut_at_stop", "StreamText"]

_PARTIAL = "\ufffd"  # what a decoder makes of a UTF-8 character whose last bytes have not come yet


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
    """Incremental text of one row, equal to `cut_at_stop` over its whole token list at every
    step, for a step's work that does not grow with the row.

    Each call gives the text that is new and settled: it holds back the last (longest stop
    string - 1) characters, which could still start a stop string, and a trailing run of
    replacement characters, which may be a partial UTF-8 character (until the row ends);
    `stopped` once a stop string has cut it.

    Incremental detokenization: the text of `toks[:read]` is final (it did not end in a
    partial character); a step decodes only `toks[prefix:]` and `toks[prefix:read]`, the
    text past the latter being the new text (the tokens before `read` give a decoder that
    treats a list's first token apart, e.g. stripping its space, the same context in
    both). That equals the whole list's decode for a decoder whose text of a list starts
    with the text of any prefix of it that ends on a whole character: byte-level BPE
    (tests/test_stops.py). One that rewrites settled text (SentencePiece's byte fallback
    turns every byte of a run that is not valid UTF-8 into a replacement character, the
    valid ones before it included; `clean_up_tokenization_spaces` drops a space before
    punctuation) cannot take back what was shown: the new text is then what lies past the
    settled text's length, as in vLLM. Stop strings are searched in the new text and the
    (longest stop - 1) characters before it.
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.tokens = 0  # tokens behind the text shown
        self.stopped = False
        self._prefix = self._read = 0  # token offsets: the window's start, the end of the final text
        self._final = 0  # characters of the final text (the text of toks[:read])
        self._shown = 0  # characters shown
        self._tail, self._tail_at = "", 0  # the final text from character _tail_at on
        self._marks, self._mark_chars = [0], [0]  # each read offset so far and its final characters

    def _decode(self, toks: Sequence[int]) -> str:
        return self.tok.decode(toks, skip_special_tokens=True)

    def advance(self, toks: Sequence[int], final: bool) -> tuple[str, int]:
        """(new text, tokens behind it since the last piece) once the row has generated
        `toks` (the previous call's list and more); `final`: it has ended."""
        if self.stopped:
            return "", 0
        searched = self._final  # no stop string lies wholly in the final text of the last step
        settled = self._decode(toks[self._prefix:self._read])
        window = self._decode(toks[self._prefix:])
        new = window[len(settled):]
        text = self._tail + new  # the row's text from character _tail_at on
        if new and not new.endswith(_PARTIAL):  # settled: the window moves on
            self._prefix, self._read, self._final = self._read, len(toks), self._final + len(new)
            self._marks.append(self._read)
            self._mark_chars.append(self._final)
        at = self._tail_at
        lo = max(searched - self.holdback - at, 0)
        hits = [i for i in (text.find(s, lo) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            end, used = at + min(hits), self._covering(toks, at + min(hits))
        elif final:
            end, used = at + len(text), len(toks)
        else:
            end, used = max(at + len(text.rstrip(_PARTIAL)) - self.holdback, self._shown), len(toks)
        piece = text[self._shown - at:end - at]
        self._shown = end
        # keep what later steps read: the unshown text and the characters a stop string could start in
        keep = min(self._shown, max(self._final - self.holdback, 0))
        if keep > at:
            self._tail, self._tail_at = text[keep - at:self._final - at], keep
        else:
            self._tail = text[:self._final - at]
        if not (piece or self.stopped or final):
            return "", 0
        before, self.tokens = self.tokens, used
        return piece, used - before

    def _covering(self, toks: Sequence[int], chars: int) -> int:
        """The fewest tokens of `toks` whose text has `chars` characters or more: counted from
        the last read offset whose final text is shorter (its text decoded from the one before);
        all of them if a decoder that rewrites settled text leaves none."""
        j = bisect_left(self._mark_chars, chars) - 1
        if j < 0:
            return 0
        start, base = self._marks[j], self._mark_chars[j]
        context = self._marks[j - 1] if j else 0
        known = len(self._decode(toks[context:start]))
        return next((i for i in range(start + 1, len(toks) + 1)
                     if base + len(self._decode(toks[context:i])) - known >= chars), len(toks))
