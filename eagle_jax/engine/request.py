"""A request to the engine, and the events it answers with.

    req = engine.submit(prompt_ids, Sampling(max_new_tokens=64, temperature=0.7, seed=3))
    for event in req:                   # a thread: Delta(text, tokens, t) as text is accepted, then one Done
        ...
    async for event in req.events():    # the same on an event loop (a request submitted from one)
        ...
    req.cancel()                        # idempotent; the request ends with Done(finish_reason="abort")

`Sampling` is the one host form of a request's settings: temperature, top-k,
top-p, seed, sampler, stop strings and the new-token limit, checked when it
is made (a ValueError names the bad one). `sampling_arrays` turns the settings of
some rows into the per-row device arrays the loop samples with
(spec_decode/sampling.py's `SamplingParams`).

The engine runs requests on its own thread and hands events back with
`Request.push`, which is thread-safe. Stop strings are the engine's job (no
Delta ever holds text past a stop string), and so are token counts
(`Delta.tokens`, `Done.completion_tokens`) and acceptance counters
(`Done.spec`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import jax
import numpy as np

from eagle_jax.config import SamplingConfig
from eagle_jax.spec_decode.sampling import SamplingParams

__all__ = ["Sampling", "sampling_arrays", "to_device", "Delta", "Done", "SpecCounts", "Request", "EngineError",
           "spec_counts"]

class EngineError(RuntimeError):
    """The engine failed on a request (not the client's fault), or takes no more requests."""


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings and limits (checked when made)."""
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy (top_p and top_k are then ignored)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    seed_stream: int = 0  # prompt i of an HTTP request samples from stream i of its seed
    stop: tuple[str, ...] = ()
    # The coupled (Gumbel-max) sampler: the text is a function of the seed, alone or batched, drafting
    # at any depth or not; False: rejection sampling (spec_decode/sampling.py has both).
    coupled: bool = True

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, (int, np.integer)) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        for name in ("seed", "seed_stream"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < 2 ** 31:
                raise ValueError(f"{name} must be an int in [0, 2**31), got {v!r}")
        if not isinstance(self.coupled, bool):
            raise ValueError(f"coupled must be a bool, got {self.coupled!r}")
        if isinstance(self.stop, str) or not all(isinstance(x, str) for x in self.stop):
            raise ValueError(f"stop must be a sequence of strings, got {self.stop!r}")
        self.config()

    def config(self) -> SamplingConfig:
        """The temperature, top-k and top-p, validated (a ValueError names the bad one)."""
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def filters(self, vocab_size: int) -> bool:
        """Whether a row with these settings runs the top-k or top-p filter (`process_logits`)."""
        c = self.config()
        return 0 < c.top_k < vocab_size or c.top_p < 1.0


def sampling_arrays(rows: Sequence[Sampling]) -> SamplingParams:
    """The per-row sampling arrays of some rows ([B] each; greedy rows have temperature 0),
    always arrays, greedy included: one program for every setting."""
    configs = [s.config() for s in rows]
    return SamplingParams(temperature=to_device([c.temperature for c in configs], np.float32),
                          top_k=to_device([c.top_k for c in configs], np.int32),
                          top_p=to_device([c.top_p for c in configs], np.float32),
                          coupled=to_device([s.coupled for s in rows], bool))


def to_device(x, dtype) -> jax.Array:
    """Host values onto the device (a transfer: unlike jnp.asarray, it compiles nothing per new shape)."""
    return jax.device_put(np.asarray(x, dtype))


@dataclass
class Delta:
    """Newly accepted text and the number of tokens behind it."""
    text: str
    tokens: int
    t: float = field(default_factory=time.monotonic)


@dataclass
class SpecCounts:
    """Speculative-decoding counters of one request (vLLM's definitions)."""
    verify_steps: int  # steps that drafted and verified
    draft_tokens: int  # tokens drafted (depth per step)
    accepted: int
    per_position: list[int]  # steps that accepted at least i+1 drafts


@dataclass
class Done:
    """How a request ended; the last event of every request."""
    finish_reason: str  # "eos", "stop" (a stop string), "length" (max_new_tokens), "context" or "abort"
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None  # arrival to first token (None when none came)
    wall_s: float  # arrival to the end
    spec: SpecCounts | None = None
    extra: dict = field(default_factory=dict)  # engine facts for the response's `eagle` block


class Request:
    """A submitted request: its events, its cancellation. Made where it is submitted: on an
    event loop its events are awaited (`events`), elsewhere iterated (`for event in req`)."""

    def __init__(self, prompt_ids: list[int], sampling: Sampling):
        self.prompt_ids, self.sampling = prompt_ids, sampling
        self.arrived = time.monotonic()
        try:
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
        except RuntimeError:  # no event loop: a thread waits on a plain queue
            self._loop, self._queue = None, queue.SimpleQueue()
        self._cancelled = threading.Event()
        self.finished = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()

    def push(self, event: Delta | Done | BaseException) -> None:
        """Hand an event to whoever waits for it (from any thread)."""
        if self._loop is None:
            self._queue.put(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop is gone: nobody is waiting
            pass

    def _take(self, event) -> Delta | Done:
        if isinstance(event, BaseException):
            self.finished = True
            raise EngineError(f"{type(event).__name__}: {event}") from event
        if isinstance(event, Done):
            self.finished = True  # before the caller sees it: nothing is left to wait for
        return event

    async def events(self) -> AsyncIterator[Delta | Done]:
        """Deltas as they come, then the Done; an engine failure raises EngineError."""
        if self._loop is None:
            raise RuntimeError("this request was submitted outside an event loop: iterate it instead")
        while not self.finished:
            yield self._take(await self._queue.get())

    def __iter__(self) -> Iterator[Delta | Done]:
        """As `events`, blocking, for a request submitted outside an event loop."""
        if self._loop is not None:
            raise RuntimeError("this request was submitted on an event loop: use `async for ... in events()`")
        while not self.finished:
            yield self._take(self._queue.get())


def spec_counts(stats, row: int) -> SpecCounts | None:
    """Row `row` of a SpecStats (host or device arrays), or None for plain decoding."""
    if stats is None:
        return None
    return SpecCounts(verify_steps=int(np.asarray(stats.steps)[row]),
                      draft_tokens=int(np.asarray(stats.drafted)[row]),
                      accepted=int(np.asarray(stats.accepted)[row]),
                      per_position=[int(x) for x in np.asarray(stats.per_position)[row]])
