"""What the HTTP layer needs from a decoding engine, and today's engine behind it.

The HTTP layer (serve/server.py) talks to an engine through four things only:

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

`BatcherEngine` implements it around one `eagle_jax.generate.Generator`:
non-streamed requests go to serve/batcher.py (static batches of requests that
are all greedy or all sampled, each row with its own settings); a streamed request runs alone on its own thread, one
jitted step at a time, taking the engine lock per step so that batches and
other streams interleave with it. What it cannot do: cancel a row inside a
running static batch (that batch is one compiled loop; the row's result is
dropped when it ends) -- a queued request or a stream stops at once, at the
latest after the step in flight.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from eagle_jax.serve.batcher import Batcher, BatchSlice

__all__ = ["Sampling", "Delta", "Done", "SpecCounts", "Request", "BatcherEngine", "EngineError"]

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


def _first_stop(text: str, stop) -> int | None:
    hits = [text.find(s) for s in stop if s and s in text]
    return min(hits) if hits else None


class BatcherEngine:
    """The present engine: static batches (serve/batcher.py) and step-by-step streams."""

    def __init__(self, generator, *, draft_name: str = "none", max_batch: int = 8, batch_window_s: float = 0.005):
        self.gen = generator
        self.draft = draft_name if generator.speculative else "none"
        self.tokenizer = generator.tokenizer
        self.context_limit = generator.context_limit
        self.vocab_size = generator.target_cfg.vocab_size
        self.lock = threading.Lock()  # one batch or one stream step on the device at a time
        self.batcher = Batcher(generator, self.lock, max_batch=max_batch, window_s=batch_window_s)
        self._streams_waiting = 0
        self._streams_running = 0
        self._count_lock = threading.Lock()
        self.closed = False

    # ------------------------------------------------------------ the interface

    def info(self) -> dict:
        gen = self.gen
        info = {"draft": self.draft, "method": gen.spec.method if gen.speculative else "plain"}
        if gen.speculative:  # batches of more requests than this decode plainly
            info["disable_by_batch_size"] = gen.disable_by_batch_size
        return info

    def check(self, prompt_ids: list[int]) -> None:
        self.gen.encode_prompts([prompt_ids], chat=False)

    def load(self) -> tuple[int, int]:
        running, waiting = self.batcher.load()
        with self._count_lock:
            return running + self._streams_running, waiting + self._streams_waiting

    def submit(self, prompt_ids: list[int], sampling: Sampling, *, stream: bool) -> Request:
        if self.closed:
            raise EngineError("the server is shutting down")
        req = Request(prompt_ids, sampling)
        if stream:
            with self._count_lock:
                self._streams_waiting += 1
            threading.Thread(target=self._stream, args=(req,), name="eagle-jax-stream", daemon=True).start()
        else:
            self.batcher.submit(prompt_ids, _generate_kw(sampling), lambda out: self._deliver(req, out),
                                lambda: req.cancelled)
        return req

    def close(self) -> None:
        self.closed = True
        self.batcher.close()

    # ------------------------------------------------------------ batches

    def _deliver(self, req: Request, out: BatchSlice | BaseException | None) -> None:
        """Turn the batcher's outcome for one request into its events."""
        if isinstance(out, BaseException):
            return req.push(out)
        now = time.monotonic()
        if out is None:  # cancelled while queued
            return req.push(Done("abort", len(req.prompt_ids), 0, None, now - req.arrived))
        res, r = out.result, out.rows[0]
        toks = res.token_ids[r]
        if req.cancelled:  # its batch ran on: drop the result
            return req.push(Done("abort", res.prompt_tokens[r], 0, None, now - req.arrived))
        req.push(Delta(res.texts[r], len(toks)))
        req.push(Done(_FINISH[res.finish_reasons[r]], res.prompt_tokens[r], len(toks),
                      out.queue_s + res.ttft_s, now - req.arrived,
                      _spec_counts(res.spec_stats, r),
                      {"batch_size": out.batch_size, "queue_s": out.queue_s,
                       "tokens_per_s": len(toks) / max(res.wall_s, 1e-9)}))

    # ------------------------------------------------------------ streams

    def _stream(self, req: Request) -> None:
        started = False
        try:
            for _ in self._stream_events(req):
                if not started:
                    started = True
                    with self._count_lock:
                        self._streams_waiting -= 1
                        self._streams_running += 1
        except BaseException as e:  # noqa: BLE001 - the waiting handler reports it
            req.push(e)
        finally:
            with self._count_lock:
                if started:
                    self._streams_running -= 1
                else:
                    self._streams_waiting -= 1

    def _stream_events(self, req: Request):
        """Run one prompt step by step, pushing Deltas and a Done; yields after each step.

        Uses the Generator's one-row step loop (its private `_prepare`; see the
        module docstring: the continuous-batching engine replaces this)."""
        from eagle_jax.spec import loop

        gen, s = self.gen, req.sampling
        ids, lc, args, static, _ = gen._prepare([req.prompt_ids], s.max_tokens, (s.temperature, s.top_k, s.top_p),
                                                [(s.seed, s.seed_stream)], False, [list(s.stop)])
        dparams, vocab = gen._drafter_for(lc)
        text = _StreamText(gen.tokenizer, s.stop)
        ttft = None
        if req.cancelled:  # gone before it started
            req.push(Done("abort", len(ids[0]), 0, None, time.monotonic() - req.arrived))
            return
        with self.lock:
            state = loop.prefill_jit(gen.target_params, dparams, vocab, *args, **static)
            n = int(state.num_generated[0])
        while True:
            ttft = ttft if ttft is not None else time.monotonic() - req.arrived
            toks = np.asarray(state.out[0, :n]).tolist()
            final = bool(state.done[0]) or req.cancelled
            piece, used = text.advance(toks, final)
            if piece:
                req.push(Delta(piece, used))
            yield
            if text.stopped or final:
                break
            with self.lock:
                state = loop.step_jit(gen.target_params, dparams, vocab, state, lc=lc)
                n = int(state.num_generated[0])
        if text.stopped:
            reason = "stop"
        elif req.cancelled and not bool(state.done[0]):
            reason = "abort"
        else:
            reason = _FINISH[gen._finish_reason(len(ids[0]), toks)]
        stats = state.stats if lc.speculative else None
        req.push(Done(reason, len(ids[0]), text.tokens, ttft, time.monotonic() - req.arrived,
                      _spec_counts(stats, 0)))


class _StreamText:
    """Incremental detokenizing of one row: new text, holding back what could
    still start a stop string or is a partial UTF-8 character; cut at a stop."""

    def __init__(self, tokenizer, stop):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.shown = ""
        self.tokens = 0  # tokens behind the text shown
        self.stopped = False

    def advance(self, toks: list[int], final: bool) -> tuple[str, int]:
        """(new text, tokens behind it) once `toks` are generated."""
        text = self.tok.decode(toks, skip_special_tokens=True)
        cut = _first_stop(text, self.stop)
        if cut is not None:
            text, self.stopped = text[:cut], True
            toks = self._covering(toks, text)
        elif not final and self.holdback:
            text = text[:max(len(text) - self.holdback, len(self.shown))]
        if text.endswith("\ufffd") and not (final or self.stopped):
            return "", 0
        piece, before = text[len(self.shown):], self.tokens
        self.shown, self.tokens = text, len(toks)
        return piece, self.tokens - before

    def _covering(self, toks: list[int], prefix: str) -> list[int]:
        """The shortest token prefix whose text covers `prefix`."""
        for i in range(len(toks) + 1):
            if len(self.tok.decode(toks[:i], skip_special_tokens=True)) >= len(prefix):
                return toks[:i]
        return toks


def _generate_kw(s: Sampling) -> dict:
    return {"max_new_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "seed": (s.seed, s.seed_stream), "stop": list(s.stop)}
