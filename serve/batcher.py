"""Cross-request batching for `eagle-jax serve`.

Requests that arrive within a short window of each other and ask for the same
sampling (temperature, top_p, top_k; every greedy request shares one group)
run as one static batch: one compiled prefill and one compiled loop, each row
with its own max_tokens, stop strings and seed. A batch ends when its longest
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
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

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
    ids: list[list[int]]
    kw: dict
    arrived: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    out: BatchSlice | None = None
    error: BaseException | None = None

    @property
    def sampling(self) -> tuple:
        """The batching key: what the compiled loop fixes (greedy ignores top_p and top_k)."""
        if self.kw["temperature"] == 0:
            return 0.0, 1.0, 0
        return self.kw["temperature"], self.kw["top_p"], self.kw["top_k"]


def _padded(n: int, max_batch: int) -> int:
    """The next power of two >= n, capped at max(max_batch, n)."""
    return min(1 << (n - 1).bit_length(), max(max_batch, n))


class Batcher:
    """Runs submitted requests on one Generator from a worker thread, batching
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
        threading.Thread(target=self._work, name="eagle-jax-batcher", daemon=True).start()

    def close(self) -> None:
        """Stop the worker once the queue is empty (later submits fail)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def submit(self, ids: list[list[int]], kw: dict) -> BatchSlice:
        """Run one request (token-id prompts, generate() keywords); blocks until done."""
        job = _Job(ids, kw)
        with self._cv:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            self._jobs.append(job)
            self._cv.notify()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.out

    def _take(self) -> list[_Job] | None:
        """Wait for the oldest job, then for the window to close or the batch to fill;
        return it with every queued job of the same sampling that still fits
        (None once closed and drained)."""
        with self._cv:
            while not self._jobs:
                if self._closed:
                    return None
                self._cv.wait()
            first = self._jobs[0]
            while True:
                mates = [j for j in self._jobs if j.sampling == first.sampling]
                left = first.arrived + self.window_s - time.monotonic()
                if sum(len(j.ids) for j in mates) >= self.max_batch or left <= 0:
                    break
                self._cv.wait(left)
            batch, rows = [], 0
            for j in mates:
                if not batch or rows + len(j.ids) <= self.max_batch:
                    batch.append(j)
                    rows += len(j.ids)
            for j in batch:
                self._jobs.remove(j)
            return batch

    def _work(self) -> None:
        while (batch := self._take()) is not None:
            self._serve(batch)

    def _serve(self, batch: list[_Job]) -> None:
        """Run a batch and hand each job its rows; a failed batch of several jobs
        is retried job by job, so each job gets its own outcome."""
        try:
            with self.lock:
                start = time.monotonic()
                result, rows, n = self._run(batch)
            for job, r in zip(batch, rows):
                job.out = BatchSlice(result, r, n, start - job.arrived)
        except BaseException as e:  # noqa: BLE001 - the waiting request gets the failure
            if len(batch) > 1:
                for job in batch:
                    self._serve([job])
                return
            batch[0].error = e
        for job in batch:
            job.done.set()

    def _run(self, batch: list[_Job]):
        ids, max_new, seeds, stops, rows = [], [], [], [], []
        for job in batch:
            rows.append(list(range(len(ids), len(ids) + len(job.ids))))
            ids += job.ids
            max_new += [job.kw["max_new_tokens"]] * len(job.ids)
            seeds += [(job.kw["seed"], i) for i in range(len(job.ids))]
            stops += [job.kw["stop"]] * len(job.ids)
        n = len(ids)
        pad = _padded(n, self.max_batch) - n  # finished after their first token
        temperature, top_p, top_k = batch[0].sampling
        result = self.gen.generate(ids + [ids[0]] * pad, chat=False, max_new_tokens=max_new + [1] * pad,
                                   temperature=temperature, top_p=top_p, top_k=top_k,
                                   seed=seeds + [0] * pad, stop=stops + [[]] * pad)
        return result, rows, n
