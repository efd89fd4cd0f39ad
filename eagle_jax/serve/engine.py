"""What the HTTP layer needs from a decoding engine.

The HTTP layer (serve/cli.py) talks to an engine through four things only:

    req = engine.submit(prompt_ids, Sampling(max_tokens=64, temperature=0.7, seed=3), stream=True)
    async for event in req.events():   # Delta(text, tokens, t) as text is accepted, then one Done
        ...
    req.cancel()                        # idempotent; the request ends with Done(finish_reason="abort")
    engine.load()                       # (running, waiting) requests, for /metrics
    engine.check(prompt_ids)            # raises ValueError (a 400) for a prompt the engine cannot take
    engine.info()                       # facts for /health (draft, method, ...)
    engine.tokenizer, engine.context_limit, engine.vocab_size
    engine.close()                      # no more submits

`submit` is called from the server's event loop and does not block (it raises
EngineError when the engine takes no more requests); the engine
runs requests on its own threads and hands events back with `Request.push`,
which is thread-safe. Stop strings are the engine's job (no Delta ever holds
text past a stop string), and so are token counts (`Delta.tokens`,
`Done.completion_tokens`) and acceptance counters (`Done.spec`).

serve/slots.py's `SlotEngine` implements it (continuous batching over row
slots); the helpers below that turn a row's tokens into its events
(`_spec_counts`, `_FINISH`) are shared with anything that implements it, and
so is `eagle_jax.stops.StreamText`, the incremental text that
`Generator.stream` shows too.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

__all__ = ["Sampling", "Delta", "Done", "SpecCounts", "Request", "EngineError"]

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class EngineError(RuntimeError):
    """The engine failed on a request (not the client's fault)."""


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings and limits."""
    max_tokens: int
    temperature: float = 0.0  # 0 = greedy (top_p and top_k are then ignored)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    seed_stream: int = 0  # prompt i of an HTTP request samples from stream i of its seed
    stop: tuple[str, ...] = ()


@dataclass
class Delta:
    """Newly accepted text and the number of tokens behind it."""
    text: str
    tokens: int
    t: float = field(default_factory=time.monotonic)


@dataclass
class SpecCounts:
    """Speculative-decoding counters of one request (vLLM's definitions)."""
    drafts: int  # verify steps
    draft_tokens: int  # tokens drafted (depth per step)
    accepted: int
    per_position: list[int]  # steps that accepted at least i+1 drafts


@dataclass
class Done:
    """How a request ended; the last event of every request."""
    finish_reason: str  # "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None  # arrival to first token (None when none came)
    wall_s: float  # arrival to the end
    spec: SpecCounts | None = None
    extra: dict = field(default_factory=dict)  # engine-specific facts for the response's `eagle` block


class Request:
    """A submitted request: its events, its cancellation. Made on the event loop."""

    def __init__(self, prompt_ids: list[int], sampling: Sampling):
        self.prompt_ids, self.sampling = prompt_ids, sampling
        self.arrived = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self.finished = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()

    def push(self, event: Delta | Done | BaseException) -> None:
        """Hand an event to the waiting handler (from any thread)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the server's loop is gone: nobody is waiting
            pass

    async def events(self) -> AsyncIterator[Delta | Done]:
        """Deltas as they come, then the Done; an engine failure raises EngineError."""
        while True:
            event = await self._queue.get()
            if isinstance(event, BaseException):
                self.finished = True
                raise EngineError(f"{type(event).__name__}: {event}") from event
            if isinstance(event, Done):
                self.finished = True  # before the handler sees it: nothing is left to wait for
                yield event
                return
            yield event


def _spec_counts(stats, row: int) -> SpecCounts | None:
    """Row `row` of a SpecStats (host or device arrays), or None for plain decoding."""
    if stats is None:
        return None
    return SpecCounts(drafts=int(np.asarray(stats.steps)[row]), draft_tokens=int(np.asarray(stats.drafted)[row]),
                      accepted=int(np.asarray(stats.accepted)[row]),
                      per_position=[int(x) for x in np.asarray(stats.per_position)[row]])
