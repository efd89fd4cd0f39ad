"""Cross-request batching for `eagle-jax serve`.

Requests that arrive within a short window of each other run as one static
batch if they are all greedy or all not: one compiled prefill and one
compiled loop, each row with its own max_tokens, stop strings, seed and
sampling settings (per-row arrays of the loop, so a new temperature, top_p or
top_k compiles nothing). A batch ends when its longest
row ends, so a short request batched with a long one waits for it.

Rows accept different numbers of drafts per step and draw from their own
per-row keys (prompt i of a request seeded s uses stream i of s, as
`Generator.generate(prompts, seed=s)` does), so a request's output does not
depend on what shares its batch, up to the floating-point rounding of a
differently shaped batch (exact in the fp32 CPU tests).

The batch is padded with finished dummy rows up to a power of two (at most
`max_batch`), so a handful of compiled shapes serve every batch size. If a
batch of several requests fails, each request is retried alone, so one
request's failure is its own.

A job is one prompt with a callback for its outcome. A job cancelled while it
waits is dropped (its callback gets None); a running batch cannot be stopped:
it is one compiled loop.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Batcher", "BatchSlice"]


@dataclass
class BatchSlice:
    """One request's rows of a batched GenerationResult."""
    result: object  # eagle_jax.generate.GenerationResult of the whole batch
    rows: list[int]  # this request's rows in it
    batch_size: int  # real (unpadded) rows in the batch
    queue_s: float  # from arrival until its batch started running


@dataclass
class _Job:
    ids: list[int]
    kw: dict
    deliver: Callable[[BatchSlice | BaseException | None], None]
    cancelled: Callable[[], bool]
    arrived: float = field(default_factory=time.monotonic)

    @property
    def greedy(self) -> bool:
        """The batching key: what the compiled loop fixes."""
        return self.kw["temperature"] == 0


def _padded(n: int, max_batch: int) -> int:
    """The next power of two >= n, capped at max(max_batch, n)."""
    return min(1 << (n - 1).bit_length(), max(max_batch, n))


class Batcher:
    """Runs submitted prompts on one Generator from a worker thread, batching
    compatible ones. `lock` is held while a batch runs (streams take it too)."""

    def __init__(self, generator, lock: threading.Lock, *, max_batch: int = 8, window_s: float = 0.005):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if window_s < 0:
            raise ValueError(f"the batch window must be >= 0 s, got {window_s}")
        self.gen, self.lock = generator, lock
        self.max_batch, self.window_s = max_batch, window_s
        self._jobs: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._running = 0  # rows taken to run whose outcome is not delivered yet
        threading.Thread(target=self._work, name="eagle-jax-batcher", daemon=True).start()

    def close(self) -> None:
        """Stop the worker once the queue is empty (later submits fail)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def load(self) -> tuple[int, int]:
        """(rows running, prompts waiting)."""
        with self._cv:
            return self._running, len(self._jobs)

    def submit(self, ids: list[int], kw: dict, deliver, cancelled=lambda: False) -> None:
        """Queue one token-id prompt with generate() keywords (`seed` a (seed, stream)
        pair); `deliver` later gets its BatchSlice, its exception, or None when
        `cancelled()` turned true before it ran. Does not block."""
        job = _Job(ids, kw, deliver, cancelled)
        with self._cv:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            self._jobs.append(job)
            self._cv.notify()

    def _take(self) -> list[_Job] | None:
        """Wait for the oldest job, then for the window to close or the batch to fill;
        return it with the queued jobs that still fit and are as greedy as it
        (None once closed and drained, [] when every waiting job was cancelled)."""
        with self._cv:
            while not self._jobs:
                if self._closed:
                    return None
                self._cv.wait()
            self._drop_cancelled()
            if not self._jobs:
                return []
            first = self._jobs[0]
            while True:
                mates = [j for j in self._jobs if j.greedy == first.greedy]
                left = first.arrived + self.window_s - time.monotonic()
                if len(mates) >= self.max_batch or left <= 0:
                    break
                self._cv.wait(left)
            batch = mates[:self.max_batch]
            for j in batch:
                self._jobs.remove(j)
            self._running = len(batch)
            return batch

    def _drop_cancelled(self) -> None:
        for j in [j for j in self._jobs if j.cancelled()]:
            self._jobs.remove(j)
            j.deliver(None)

    def _work(self) -> None:
        while (batch := self._take()) is not None:
            if batch:
                self._serve(batch)

    def _deliver(self, job: _Job, outcome) -> None:
        """Count the job out of the running rows, then hand it its outcome (so a client
        that reads the server's load after its reply never counts itself)."""
        with self._cv:
            self._running -= 1
        job.deliver(outcome)

    def _serve(self, batch: list[_Job]) -> None:
        """Run a batch and hand each job its rows; a failed batch of several jobs
        is retried job by job, so each job gets its own outcome."""
        try:
            with self.lock:
                start = time.monotonic()
                result = self._run(batch)
        except BaseException as e:  # noqa: BLE001 - the waiting request gets the failure
            if len(batch) > 1:
                for job in batch:
                    self._serve([job])
            else:
                self._deliver(batch[0], e)
            return
        for r, job in enumerate(batch):
            self._deliver(job, BatchSlice(result, [r], len(batch), start - job.arrived))

    def _run(self, batch: list[_Job]):
        n = len(batch)
        pad = _padded(n, self.max_batch) - n  # finished after their first token
        rows = batch + [batch[0]] * pad
        return self.gen.generate([j.ids for j in batch] + [batch[0].ids] * pad, chat=False,
                                 max_new_tokens=[j.kw["max_new_tokens"] for j in batch] + [1] * pad,
                                 temperature=[j.kw["temperature"] for j in rows],
                                 top_p=[j.kw["top_p"] for j in rows], top_k=[j.kw["top_k"] for j in rows],
                                 seed=[j.kw["seed"] for j in batch] + [0] * pad,
                                 stop=[j.kw["stop"] for j in batch] + [[]] * pad)
