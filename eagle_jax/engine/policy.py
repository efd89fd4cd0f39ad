"""The draft depth of each engine step (0: plain), chosen from measured step costs and
measured acceptance, as vLLM and SGLang lower speculation under load."""

from __future__ import annotations

from functools import partial

__all__ = ["DraftPolicy", "draft_depths"]


def draft_depths(deepest: int) -> tuple[int, ...]:
    """The draft depths an adaptive engine compiles: 1, 2, 4, ... below `deepest`, and `deepest`."""
    return tuple(sorted({1 << i for i in range(deepest.bit_length()) if 1 << i < deepest} | {deepest}))


class DraftPolicy:
    """The draft depth of each step (0: plain), by expected seconds per token.

    A step at depth d over a row bucket takes `load * base[rows, d, filtered]`
    seconds: `base` holds the warm-up's timings, apart for steps where some
    row asks for top-k or top-p (`filtered`: those filters then run, over
    every drafted position), and `load` is one running mean, over every step,
    of its measured seconds over its warm-up seconds. Whatever else runs on
    the machine slows every depth alike, so it moves `load`, not the ranking
    of the depths. (A running mean per depth let a busy spell of plain steps
    make the untried drafting depths look cheap; the engine then switched
    back and forth, paying catch-ups at each switch: 0.92x plain at
    concurrency 4 on two cores. So did keeping the least time each depth had
    taken: the depth run most, on a machine shared with other work, got the
    luckiest minimum. And the warm-up once timed every step with the filters
    on, as its rows asked for them: drafting looked 23-37% dearer against
    plain than it is for greedy rows (4 rows, Xeon), and the engine stayed plain at 4 rows
    where drafting 2 tokens ran 1.1-1.2x faster.)
    A step at depth d emits 1 + accept[0] + ... + accept[d-1] tokens a row,
    where accept[i] is the share of rows that accepted more than i drafts at
    the steps that drafted past position i (a chain cut to d tokens accepts
    min(accepted, d)), with Laplace's prior ((hits + 1) / (trials + 2): one
    row a step at concurrency 1 is a noisy sample) over counts that decay by
    `decay` every step, plain ones included: they follow the rows running now,
    and a long plain spell (after rows that accepted little) drifts back to
    the prior, so drafting is tried again for the rows that came since. A
    drafting step first pays for the catch-up calls that bring the drafter
    level after new prompts or plain steps (`base[rows, "catch_up"]` each);
    drafting goes on once started, so that cost is spread over the tokens the
    rows have left (`horizon`). While a shallower depth wins, a deepest step
    measures every position again after `probe` of them, then after twice as
    many each time (up to 8x), unless it would lose even if every draft were
    accepted and its catch-up were paid by its own tokens (on two AVX2 cores,
    at concurrency 4, probes that paid about 10 catch-up calls each ran
    0.92-0.93x plain).
    """

    def __init__(self, costs: dict[tuple, float], deepest: int, probe: int = 16, keep: float = 0.8,
                 decay: float = 0.95):
        self.base = dict(costs)  # {(rows, depth, filtered): s, (rows, "catch_up"): s}: Engine._warm_up's
        self.load = 1.0
        self.depths = sorted({k[1] for k in costs if k[1] != "catch_up"})
        self.deepest, self.probe, self.keep, self.decay = deepest, probe, keep, decay
        self._hits, self._trials = [0.0] * deepest, [0.0] * deepest
        self._shallow_run, self._wait = 0, probe

    @property
    def accept(self) -> list[float]:
        return [(h + 1) / (t + 2) for h, t in zip(self._hits, self._trials)]

    def tokens(self, depth: int) -> float:
        """Expected tokens a row from a step at `depth`."""
        return 1.0 + sum(self.accept[:depth])

    def seconds(self, rows: int, depth: int | str, filtered: bool = False) -> float:
        """Expected seconds of a step (or a catch-up call) over `rows` rows, at the present load;
        `filtered`: some row asks for top-k or top-p."""
        return self.load * self.base[(rows, depth) if depth == "catch_up" else (rows, depth, filtered)]

    def seconds_per_token(self, rows: int, depth: int, catch_up_calls: int = 0, horizon: float = 1.0,
                          tokens: float | None = None, filtered: bool = False) -> float:
        """A row's expected seconds per token at `depth` (tokens: as if each step emitted that many)."""
        per_step = self.seconds(rows, depth, filtered) / (self.tokens(depth) if tokens is None else tokens)
        return per_step + (catch_up_calls * self.seconds(rows, "catch_up") / horizon
                           if depth and catch_up_calls else 0.0)

    def choose(self, rows: int, catch_up_calls: int = 0, horizon: float = 1.0, filtered: bool = False) -> int:
        """The depth of the next step over `rows` rows, whose drafter is `catch_up_calls` behind
        and which have `horizon` tokens left on average (`filtered`: as in `seconds`)."""
        cost = partial(self.seconds_per_token, rows, catch_up_calls=catch_up_calls, horizon=horizon,
                       filtered=filtered)
        best = min(self.depths, key=cost)
        if best == self.deepest:
            self._shallow_run, self._wait = 0, self.probe
            return best
        self._shallow_run += 1
        # No probe where it would lose even if every draft were accepted, with its catch-up charged to
        # its own tokens (a probe is one step: more rows than drafting pays for stay plain for good).
        full = self.deepest + 1
        if self._shallow_run < self._wait or cost(self.deepest, horizon=full, tokens=full) > cost(best):
            return best
        self._shallow_run, self._wait = 0, min(2 * self._wait, 8 * self.probe)
        return self.deepest

    def observe(self, rows: int, depth: int, seconds: float, counts: list[int], filtered: bool = False) -> None:
        """A step at `depth` took `seconds`; `counts`: new tokens of each row that emitted any."""
        self.load = self.keep * self.load + (1 - self.keep) * seconds / self.base[rows, depth, filtered]
        self._hits = [self.decay * h for h in self._hits]
        self._trials = [self.decay * t for t in self._trials]
        for i in range(depth if counts else 0):
            self._hits[i] += sum(c - 1 > i for c in counts)
            self._trials[i] += len(counts)
