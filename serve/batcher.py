"""Cross-request batching for `eagle-jax serve`.

Requests that arrive within a short window of each other and ask for the same
sampling (temperature, top_p, top_k) run as one batch: one compiled prefill and
one compiled loop, each row with its own max_tokens, stop strings and seed.
Rows accept different numbers of drafts per step, so nothing in one request
changes another's output: greedy rows give what they give alone, and sampled
rows draw from their own per-row keys (prompt i of a request seeded s is
seeded s + i, in a batch or not).

The batch is padded with finished dummy rows up to a power of two (at most
`max_batch`), so a handful of compiled shapes serve every batch size.
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
        threading.Thread(target=self._work, name="eagle-jax-batcher", daemon=True).start()

    def submit(self, ids: list[list[int]], kw: dict) -> BatchSlice:
        """Run one request (token-id prompts, generate() keywords); blocks until done."""
        job = _Job(ids, kw)
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.out

    def _take(self) -> list[_Job]:
        """Wait for the oldest job, then for the window to close or the batch to fill;
        return it with every queued job of the same sampling that still fits."""
        with self._cv:
            while not self._jobs:
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
        while True:
            batch = self._take()
            try:
                with self.lock:
                    result, rows, n = self._run(batch)
                for job, r in zip(batch, rows):
                    job.out = BatchSlice(result, r, n)
            except BaseException as e:  # noqa: BLE001 - every waiting request gets the failure
                for job in batch:
                    job.error = e
            for job in batch:
                job.done.set()

    def _run(self, batch: list[_Job]):
        ids, max_new, seeds, stops, rows = [], [], [], [], []
        for job in batch:
            rows.append(list(range(len(ids), len(ids) + len(job.ids))))
            ids += job.ids
            max_new += [job.kw["max_new_tokens"]] * len(job.ids)
            seeds += [job.kw["seed"] + i for i in range(len(job.ids))]
            stops += [job.kw["stop"]] * len(job.ids)
        n = len(ids)
        pad = _padded(n, self.max_batch) - n  # finished after their first token
        temperature, top_p, top_k = batch[0].sampling
        result = self.gen.generate(ids + [ids[0]] * pad, chat=False, max_new_tokens=max_new + [1] * pad,
                                   temperature=temperature, top_p=top_p, top_k=top_k,
                                   seed=seeds + [0] * pad, stop=stops + [[]] * pad)
        return result, rows, n
