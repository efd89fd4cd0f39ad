"""The HTTP layer of `eagle-jax serve` (serve/cli.py has the endpoints and the command line).

FastAPI (Starlette) on uvicorn; it talks to the engine only through
the engine's interface (eagle_jax/engine/: submit / events / cancel / load / check / info).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import re
import signal
import socket
import threading
import time
import uuid
from functools import partial
from http import HTTPStatus

import h11
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from eagle_jax.engine import Delta, Done, Engine, EngineError, Sampling
from eagle_jax.serve import protocol as P
from eagle_jax.serve.limits import Limits, bind
from eagle_jax.serve.metrics import CONTENT_TYPE_LATEST, Metrics
from eagle_jax.serve.protocol import FINISH_REASONS, ApiError

__all__ = ["create_app", "Server", "make_server"]

log = logging.getLogger("eagle_jax.serve")


# ---------------------------------------------------------------------------- the app


def create_app(engine, *, model_name: str, limits: Limits = Limits(), api_key: str | None = None) -> FastAPI:
    """The ASGI app serving `engine` (an eagle_jax.engine.Engine, or anything with its interface) as
    `model_name`."""
    app = FastAPI(title="eagle-jax", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(model_name, engine.load)
    api = _Api(engine, model_name, limits, metrics)
    created = int(time.time())

    async def refused(_, e: ApiError):
        return _error(e)

    async def no_route(r: Request, e: StarletteHTTPException):
        what = "no route" if e.status_code == 404 else str(e.detail).lower()
        return _error(ApiError(e.status_code, f"{what}: {r.method} {r.url.path}"))

    app.add_exception_handler(ApiError, refused)
    app.add_exception_handler(StarletteHTTPException, no_route)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, **engine.info()}

    @app.get("/metrics")
    async def metrics_text():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_auth(api_key))])
    card = {"id": model_name, "object": "model", "created": created, "owned_by": "eagle-jax",
            "max_model_len": engine.context_limit}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [card]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        api.check_model(model_id)
        return card

    @v1.post("/completions")
    async def completions(request: Request):
        return await api.handle(request, "completion")

    @v1.post("/chat/completions")
    async def chat(request: Request):
        return await api.handle(request, "chat")

    app.include_router(v1)
    app.state.drain = api.drain
    return app


def _error(e: ApiError) -> JSONResponse:
    headers = {"connection": "close"} if e.status in (408, 413, 415) else None  # the body may still be coming
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _auth(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")
    return check


class _Api:
    """The two POST endpoints: read, check, tokenize, submit, answer."""

    def __init__(self, engine, model_name: str, limits: Limits, metrics: Metrics):
        self.engine, self.model, self.limits, self.metrics = engine, model_name, limits, metrics
        self.live: set = set()  # the engine requests submitted (pruned of the finished at each submit)
        self.stopping = False

    async def drain(self, timeout_s: float, give_up) -> None:
        """Take no more requests; wait up to `timeout_s` (or until `give_up()`) for those in
        flight, then end the rest: a stream with a final chunk ("abort") and [DONE], an
        answer with a 503."""
        self.stopping = True
        deadline = time.monotonic() + timeout_s
        if self._running():
            log.warning("shutting down: waiting up to %g s for %d requests", timeout_s, len(self._running()))
        while self._running() and time.monotonic() < deadline and not give_up():
            await asyncio.sleep(0.05)
        left = self._running()
        for r in left:
            r.cancel()
        if left:
            log.warning("shutting down: %d requests ended unfinished (--shutdown-timeout)", len(left))
        while self._running() and not give_up():
            await asyncio.sleep(0.05)

    def _running(self) -> list:
        return [r for r in self.live if not r.finished]

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves {self.model!r}",
                           param="model", code="model_not_found")

    async def handle(self, request: Request, kind: str):
        _check_json(request)
        try:
            raw = await _read_body(request, self.limits)
        except ClientDisconnect:
            if "malformed" not in request.scope.get("state", {}):  # else the parser answered it (_H11)
                log.warning("client disconnected before its request body arrived")
            return Response(status_code=499)
        body = P.parse_json(raw)
        req = P.validated(P.ChatBody if kind == "chat" else P.CompletionBody, body)
        self.check_model(req.model)
        sampling = self._sampling(req)
        prompts = await asyncio.to_thread(self._encode, kind, req)
        if req.stream and len(prompts) != 1:
            raise ApiError(400, "stream takes a single prompt", param="prompt")
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if self.stopping:
            raise ApiError(503, "the server is shutting down: it takes no more requests")
        try:
            reqs = [self.engine.submit(ids, Sampling(**{**sampling, "seed_stream": i}))
                    for i, ids in enumerate(prompts)]
        except EngineError as e:  # e.g. shutting down
            raise ApiError(503, str(e)) from None
        self.live = set(self._running()) | set(reqs)
        reply = _Reply(rid, kind, self.model, self.metrics)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _EventStream(reply.events(reqs[0], include_usage), reqs[0], reply)
        answer = await reply.whole(reqs, request)
        if self.stopping and any(r.cancelled for r in reqs):
            raise ApiError(503, "the server shut down before this request finished (--shutdown-timeout)")
        return answer

    def _sampling(self, req) -> dict:
        m = getattr(req, "max_completion_tokens", None) or req.max_tokens or self.limits.default_max_tokens
        if m > self.limits.max_tokens:
            raise ApiError(400, f"max_tokens {m} is over this server's limit of {self.limits.max_tokens} "
                                f"(--max-tokens-limit)", param="max_tokens")
        top_k = 0 if req.top_k == -1 or req.top_k >= self.engine.vocab_size else req.top_k
        seed = req.seed if req.seed is not None else random.randrange(2 ** 31)
        return {"max_new_tokens": m, "temperature": req.temperature, "top_p": req.top_p, "top_k": top_k,
                "seed": seed, "stop": P.stops_of(req.stop)}

    def _encode(self, kind: str, req) -> list[list[int]]:
        """Token ids of each prompt (chat: the rendered template), checked by the engine."""
        tok = self.engine.tokenizer
        if kind == "chat":
            if tok is None or not tok.chat_template:
                raise ApiError(400, "this model has no chat template: use /v1/completions")
            tools = "tool_calls" in tok.chat_template  # the template renders tool calls
            if req.tools is not None and not tools:
                raise ApiError(400, P.NO_TOOLS, param="tools")
            messages = P.messages_of(req.messages, tools)
            try:
                text = tok.render_chat(messages, **({"tools": req.tools} if req.tools is not None else {}))
            except Exception as e:  # noqa: BLE001 - the template refused these messages (jinja raise_exception)
                raise ApiError(400, f"the chat template refused the messages: {e}", param="messages") from None
            prompts = [tok.encode(text, add_special_tokens=False)]
        else:
            texts = P.prompts_of(req.prompt)
            if len(texts) > self.limits.max_prompts:
                raise ApiError(400, f"{len(texts)} prompts: at most {self.limits.max_prompts} per request",
                               param="prompt")
            if tok is None and any(isinstance(t, str) for t in texts):
                raise ApiError(400, "this model has no tokenizer: send token ids", param="prompt")
            prompts = [tok.encode(t) if isinstance(t, str) else t for t in texts]
        most = self.limits.max_prompt_tokens
        for i, ids in enumerate(prompts):
            if most is not None and len(ids) > most:
                raise ApiError(400, f"prompt {i} has {len(ids)} tokens: this server takes at most {most} "
                                    f"(--max-prompt-tokens)", param="prompt")
            try:
                self.engine.check(ids)
            except ValueError as e:
                raise ApiError(400, str(e), param="messages" if kind == "chat" else "prompt") from None
        return prompts


def _check_json(request: Request) -> None:
    """Refuse (415) a body not declared JSON: a web page's simple cross-origin request
    (a form, text/plain) then cannot drive this server."""
    given = request.headers.get("content-type")
    if given is None or given.split(";", 1)[0].strip().lower() != "application/json":
        raise ApiError(415, f"Content-Type must be application/json (got {given!r})",
                       code="unsupported_media_type")


async def _read_body(request: Request, limits: Limits) -> bytes:
    """The body, refused (413) past the size limit -- from Content-Length before
    reading when it is declared -- and (408) when it does not arrive in time."""
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > limits.max_body_bytes:
        raise ApiError(413, f"the body is {int(declared)} bytes: this server takes at most "
                            f"{limits.max_body_bytes} (--max-body-bytes)")
    parts, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise ApiError(413, f"the body is over {limits.max_body_bytes} bytes (--max-body-bytes)")
                parts.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive within {limits.body_timeout_s:g} s") from None
    return b"".join(parts)


# ---------------------------------------------------------------------------- responses


class _Reply:
    """One response's shape (completion or chat), built from engine events."""

    def __init__(self, rid: str, kind: str, model: str, metrics: Metrics):
        self.rid, self.kind, self.model, self.metrics = rid, kind, model, metrics
        self.created = int(time.time())
        self.tokens_sent = 0

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    async def _collect(self, req) -> tuple[str, Done]:
        text, last = [], None
        async for ev in req.events():
            if isinstance(ev, Delta):
                if last is not None:
                    self.metrics.gap(ev.t - last)
                last = ev.t
                text.append(ev.text)
            else:
                self.metrics.done(ev)
                return "".join(text), ev

    async def drain(self, req) -> None:
        """Wait out a request nobody reads any more (its Done still reaches the metrics)."""
        await self._collect(req)

    async def whole(self, reqs, request: Request):
        """The non-streamed response, or nothing once the client has gone (its requests cancelled)."""
        results = asyncio.ensure_future(asyncio.gather(*(self._collect(r) for r in reqs)))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not results.done():
            for r in reqs:
                r.cancel()
            log.warning("client disconnected: request %s cancelled", self.rid)
            results.add_done_callback(_quiet)  # it still counts the abort in the metrics
            return Response(status_code=499)
        try:
            outs = results.result()
        except EngineError as e:
            raise ApiError(500, str(e)) from None
        return self._body(outs)

    def _body(self, outs: list[tuple[str, Done]]) -> dict:
        choices = []
        for i, (text, d) in enumerate(outs):
            c = {"index": i, "finish_reason": FINISH_REASONS[d.finish_reason], "logprobs": None}
            if self.kind == "chat":
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            choices.append(c)
        prompt = sum(d.prompt_tokens for _, d in outs)
        completion = sum(d.completion_tokens for _, d in outs)
        return {**self._head("chat.completion" if self.kind == "chat" else "text_completion"),
                "choices": choices, "usage": _usage(prompt, completion), "eagle": _eagle(outs)}

    def _chunk(self, piece: str | None, finish: str | None = None) -> dict:
        c = {"index": 0, "finish_reason": finish}
        if self.kind == "chat":
            c["delta"] = {} if piece is None else {"content": piece}
        else:
            c["text"], c["logprobs"] = piece or "", None
        return {**self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion"),
                "choices": [c]}

    async def events(self, req, include_usage: bool):
        """Server-sent events of one streamed request, ending with [DONE]."""
        if self.kind == "chat":
            first = self._chunk("")
            first["choices"][0]["delta"]["role"] = "assistant"
            yield _sse(first)
        last = None
        try:
            async for ev in req.events():
                if isinstance(ev, Delta):
                    if last is not None:
                        self.metrics.gap(ev.t - last)
                    last = ev.t
                    self.tokens_sent += ev.tokens
                    yield _sse(self._chunk(ev.text))
                    continue
                self.metrics.done(ev)
                yield _sse(self._chunk(None, FINISH_REASONS[ev.finish_reason]))
                if include_usage:
                    usage = {**self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion"),
                             "choices": [], "usage": _usage(ev.prompt_tokens, ev.completion_tokens)}
                    yield _sse(usage)
        except EngineError as e:  # the headers are out: report it as an event
            yield _sse(ApiError(500, str(e)).body())
        yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """An SSE response whose request is cancelled when the response ends early
    (client gone), even before its first byte."""

    def __init__(self, events, req, reply: _Reply):
        super().__init__(events, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.req, self.reply = req, reply

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.req.finished:
                self.req.cancel()
                log.warning("client disconnected: stream %s cancelled after %d tokens", self.reply.rid,
                            self.reply.tokens_sent)
                drain = asyncio.ensure_future(self.reply.drain(self.req))  # counts the abort in the metrics
                drain.add_done_callback(_quiet)


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _quiet(f: asyncio.Future) -> None:
    """Retrieve a background task's outcome, so that a failure is not reported as unhandled."""
    if not f.cancelled():
        f.exception()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _eagle(outs: list[tuple[str, Done]]) -> dict:
    """The eagle-jax block of a response: engine facts and acceptance over its prompts."""
    done = [d for _, d in outs]
    out = {**done[0].extra, "ttft_s": done[0].ttft_s, "wall_s": max(d.wall_s for d in done)}
    specs = [d.spec for d in done if d.spec is not None]
    if specs:
        steps = sum(s.verify_steps for s in specs)
        per_pos = [sum(p) for p in zip(*(s.per_position for s in specs))]
        out["acceptance_length"] = 1 + sum(s.accepted for s in specs) / steps if steps else None
        out["per_position_acceptance"] = [p / steps for p in per_pos] if steps else []
    return out


# ---------------------------------------------------------------------------- the server


class _Conn(h11.Connection):
    """h11's connection, keeping the error that ended parsing (uvicorn reports every one
    as "Invalid HTTP request received.")."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


class _H11(H11Protocol):
    """uvicorn's h11 protocol with what it lacks:

    - a request h11 cannot parse gets a JSON error that says what was wrong (h11's
      message and status: 400, or 431 / 501), not "Invalid HTTP request received.";
    - a request whose headers have not all arrived `limits.header_timeout_s` after the
      connection opened (or after the previous response) gets a 408 and is closed; an
      idle connection is closed (uvicorn's keep-alive timer never starts on a new
      connection and stops at a request's first byte);
    - a connection opened while `limits.max_connections` others are open gets a 503 to
      its request and is closed;
    - a client that half-closes after a whole request gets its answer.

    Besides the asyncio protocol methods it relies on these members of uvicorn's
    H11Protocol (uvicorn 0.55; tests/serve/test_http.py pins them): `conn` (made in
    `__init__`, handed to each request cycle), `config`, `transport`, `loop`, `cycle`
    (and its `scope`), `connections` (the server's open connections, this one
    included), `app` (read at each request), `on_response_complete` and
    `send_400_response(msg)` (called on a parse error).
    """

    def __init__(self, *args, limits: Limits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.most_header_bytes = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.conn = _Conn(h11.SERVER, self.most_header_bytes)
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            refused = ApiError(503, f"the server has {self.limits.max_connections} connections open, its limit "
                                    f"(--max-connections): try again later")
            self.app = JSONResponse(refused.body(), status_code=503, headers={"connection": "close"})
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # between requests (a request ending its body restarts the cycle)
            self._arm()
        elif self.header_timer is not None:  # the headers are in
            self.header_timer.cancel()
            self.header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        """Start the headers' clock, unless it runs already (a byte does not reset it)."""
        if self.header_timer is None and not self.transport.is_closing():
            self.header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self.header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a request has come
            self._answer(ApiError(408, f"the request headers did not arrive within "
                                       f"{self.limits.header_timeout_s:g} s (--header-timeout-s)"))
        else:
            self.transport.close()

    def eof_received(self) -> bool | None:
        """Keep the connection open to answer a whole request whose client shut its sending
        side (then close it); end of input anywhere else is a disconnect."""
        whole = self.conn.their_state in (h11.DONE, h11.MUST_CLOSE)  # the request has arrived
        if self.cycle is not None and not self.cycle.response_complete and whole:
            self.cycle.keep_alive = False
            return True
        return None

    def send_400_response(self, msg: str) -> None:
        """Answer a request h11 could not parse with its reason (uvicorn's `msg` says none)."""
        e, status = self.conn.error, 400
        what = msg if e is None else re.sub(r"bytearray\((b.*)\)", r"\1", str(e))[:200]
        if e is not None:
            status = e.error_status_hint
            if status == 431:
                what = f"the request headers are over {self.most_header_bytes} bytes"
        if self.cycle is not None:  # the request's handler sees a disconnect: not the client's doing
            self.cycle.scope["state"]["malformed"] = what
        self._answer(ApiError(status, f"malformed HTTP request: {what}"))

    def _answer(self, e: ApiError) -> None:
        """Send `e` as a JSON response (unless a response has begun), then close."""
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            data = JSONResponse(e.body()).body
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                       (b"connection", b"close")]
            reason = HTTPStatus(e.status).phrase.encode()
            for event in (h11.Response(status_code=e.status, headers=headers, reason=reason), h11.Data(data=data),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        self.transport.close()


class _Draining(uvicorn.Server):
    """uvicorn, which on SIGTERM or SIGINT (or `should_exit`) stops accepting connections
    and drains the app's requests (`app.state.drain`) before it closes the connections;
    a drained SIGTERM is a clean exit, not re-raised."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout_s: float):
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            self._captured_signals.remove(sig)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        await self.config.app.state.drain(self.shutdown_timeout_s, lambda: self.force_exit)
        await super().shutdown(sockets)


class Server:
    """A bound server: `serve_forever()` on some thread, `shutdown()` from another,
    then `server_close()` (the socket and the engine). Either way of stopping drains the
    requests in flight for up to `shutdown_timeout_s`. Its connections obey `limits`
    (header time, open connections: `_H11`)."""

    def __init__(self, app, sock: socket.socket, engine, shutdown_timeout_s: float = 30.0,
                 limits: Limits = Limits()):
        self.sock, self.engine = sock, engine
        self.server_address = sock.getsockname()[:2]
        self.shutdown_timeout_s = shutdown_timeout_s
        config = uvicorn.Config(app, http=partial(_H11, limits=limits), lifespan="off", log_config=None,
                                access_log=False, timeout_graceful_shutdown=10, timeout_keep_alive=5)
        self._uvicorn = _Draining(config, shutdown_timeout_s)
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        try:
            self._uvicorn.run(sockets=[self.sock])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        self._uvicorn.should_exit = True
        self._stopped.wait(self.shutdown_timeout_s + 30)

    def server_close(self) -> None:
        self.engine.close()
        self.sock.close()


def make_server(generator, host: str = "127.0.0.1", port: int = 8000, *, model_name: str = "eagle-jax",
                draft_name: str = "none", max_batch: int = 8, max_len: int = 1024, prefill_chunk: int = 64,
                prefill_budget: int = 256, adaptive: bool = True, limits: Limits = Limits(),
                api_key: str | None = None, sock: socket.socket | None = None,
                shutdown_timeout_s: float = 30.0) -> Server:
    """A server (not yet started: call serve_forever) around `generator`, on `sock` or host:port:
    the engine with `max_batch` rows (max_len, prefill_chunk, prefill_budget, adaptive), which
    compiles its programs before this returns; stopping, it drains for `shutdown_timeout_s`."""
    backend = Engine(generator, max_rows=max_batch, max_len=max_len, draft_name=draft_name,
                     prefill_chunk=prefill_chunk, prefill_budget=prefill_budget, adaptive=adaptive)
    app = create_app(backend, model_name=model_name, limits=limits, api_key=api_key)
    return Server(app, sock if sock is not None else bind(host, port), backend, shutdown_timeout_s, limits)


