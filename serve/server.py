"""`eagle-jax serve`: an OpenAI-style HTTP server around one Generator.

    eagle-jax serve --port 8000                       # SmolLM2 + its bundled EAGLE 3.1 drafter
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Endpoints:
  GET  /health                 {"status": "ok", "model", "draft", "method"}
  GET  /v1/models              the one model
  POST /v1/completions         {"prompt": str | [str], ...}       raw text, no chat template
  POST /v1/chat/completions    {"messages": [{role, content}], ...} the model's chat template

Request fields (both POSTs): max_tokens (default 128), temperature (0 =
greedy), top_p, top_k, seed, stop (str or list), stream (chat and single
completion prompts: server-sent events, one chunk per accepted piece of text).
`model`, `user` and `stream_options` are accepted and ignored; any other field, `n` > 1 or
`logprobs` are rejected with 400 naming the field. Responses carry `usage`
and an `eagle` block (acceptance length, per-position acceptance, tokens/s).

Concurrent non-streamed requests with the same sampling settings are batched
together (serve/batcher.py: static batches of up to `--max-batch` rows, gathered
for `--batch-window-ms`); a request's output does not depend on what shares its
batch, and prompt i of a request seeded s samples as row i of
`Generator.generate(prompts, seed=s)`. Streamed requests run alone, one at a time.
The `eagle` block reports `batch_size` and `queue_s` (waiting before its batch ran).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from eagle_jax.config import SamplingConfig
from eagle_jax.serve.batcher import Batcher

__all__ = ["add_arguments", "main", "make_server", "RequestError"]

_SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream"}
_IGNORED_KEYS = {"model", "user", "stream_options"}
_CHECKED_KEYS = {"n", "logprobs"}  # accepted only with their default meaning
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class RequestError(ValueError):
    """A request the server refuses (HTTP 400), with a message naming the problem."""


def _check_fields(body: dict, required: str) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = set(body) - _SAMPLING_KEYS - _IGNORED_KEYS - _CHECKED_KEYS - {required}
    if unknown:
        raise RequestError(f"unknown field(s): {', '.join(sorted(unknown))}")
    if required not in body:
        raise RequestError(f"missing field {required!r}")
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1 (one completion per prompt)")
    if body.get("logprobs") not in (None, False):
        raise RequestError("logprobs are not supported")
    kw = {"max_new_tokens": body.get("max_tokens", 128), "temperature": body.get("temperature", 0.0),
          "top_p": body.get("top_p", 1.0), "top_k": body.get("top_k", 0), "seed": body.get("seed", 0)}
    m = kw["max_new_tokens"]
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise RequestError(f"max_tokens must be a positive integer, got {m!r}")
    for key in ("temperature", "top_p"):
        if not isinstance(kw[key], (int, float)) or isinstance(kw[key], bool):
            raise RequestError(f"{key} must be a number, got {kw[key]!r}")
    for key in ("top_k", "seed"):
        if not isinstance(kw[key], int) or isinstance(kw[key], bool):
            raise RequestError(f"{key} must be an integer, got {kw[key]!r}")
    # Checked here, not in the batch: one bad request must not fail the others.
    if not 0 <= kw["seed"] < 2 ** 31:
        raise RequestError(f"seed must be in [0, 2**31), got {kw['seed']}")
    try:
        SamplingConfig(temperature=kw["temperature"], top_k=kw["top_k"], top_p=kw["top_p"])
    except ValueError as e:
        raise RequestError(str(e)) from None
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or a list of strings")
    kw["stop"] = stop
    return kw


def _messages(body: dict) -> list[dict]:
    msgs = body["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RequestError(f"messages[{i}] must be an object with string 'role' and 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


class Service:
    """The request logic, independent of HTTP: validate, run, shape the response."""

    def __init__(self, generator, model_name: str, draft_name: str, *, max_batch: int = 8,
                 batch_window_s: float = 0.005):
        self.gen = generator
        self.model = model_name
        self.draft = draft_name if generator.speculative else "none"
        self.lock = threading.Lock()  # one batch or one stream on the engine at a time
        self.batcher = Batcher(generator, self.lock, max_batch=max_batch, window_s=batch_window_s)

    def info(self) -> dict:
        info = {"status": "ok", "model": self.model, "draft": self.draft,
                "method": self.gen.spec.method if self.gen.speculative else "plain"}
        if self.gen.speculative:  # batches of more requests than this decode plainly
            info["disable_by_batch_size"] = self.gen.disable_by_batch_size
        return info

    def prompts(self, kind: str, body: dict) -> tuple[list[list[int]], dict]:
        """Token-id prompts and generate() keyword arguments of a request."""
        tok = self.gen.tokenizer
        if tok is None:
            raise RequestError("this model has no tokenizer: text requests cannot be encoded")
        if kind == "chat":
            kw = _check_fields(body, "messages")
            if not tok.chat_template:
                raise RequestError("this model has no chat template: use /v1/completions")
            texts = [tok.render_chat(_messages(body))]
            ids = [tok.encode(texts[0], add_special_tokens=False)]
        else:
            kw = _check_fields(body, "prompt")
            p = body["prompt"]
            texts = [p] if isinstance(p, str) else p
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
                raise RequestError("prompt must be a non-empty string or a list of them")
            ids = [tok.encode(t) for t in texts]
        try:  # the Generator's own checks (context length, vocabulary) as a 400
            ids = self.gen.encode_prompts(ids, chat=False)
        except ValueError as e:
            raise RequestError(str(e)) from None
        return ids, kw

    def run(self, kind: str, body: dict) -> dict:
        ids, kw = self.prompts(kind, body)
        try:
            part = self.batcher.submit(ids, kw)
        except ValueError as e:  # invalid sampling parameters
            raise RequestError(str(e)) from None
        res, rows = part.result, part.rows
        choices = []
        for i, r in enumerate(rows):
            text, reason = res.texts[r], res.finish_reasons[r]
            c = {"index": i, "finish_reason": _FINISH[reason]}
            if kind == "chat":
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            choices.append(c)
        completion = sum(len(res.token_ids[r]) for r in rows)
        prompt = sum(res.prompt_tokens[r] for r in rows)
        out = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
               "object": "chat.completion" if kind == "chat" else "text_completion",
               "created": int(time.time()), "model": self.model, "choices": choices,
               "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion},
               "eagle": {"draft": self.draft, "tokens_per_s": completion / max(res.wall_s, 1e-9),
                         "ttft_s": res.ttft_s, "wall_s": res.wall_s, "batch_size": part.batch_size,
                         "queue_s": part.queue_s}}
        if self.gen.speculative:
            stats = res.stats_of(rows)
            out["eagle"].update({k: stats.get(k) for k in ("acceptance_length", "per_position_acceptance")})
        return out

    def stream(self, kind: str, body: dict):
        """Server-sent event payloads (dicts) for a streamed request, then None."""
        ids, kw = self.prompts(kind, body)
        if len(ids) != 1:
            raise RequestError("stream takes a single prompt")
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(piece, finish=None):
            c = {"index": 0, "finish_reason": finish}
            if kind == "chat":
                c["delta"] = {"content": piece} if piece else {}
            else:
                c["text"] = piece
            return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model, "choices": [c]}

        with self.lock:
            try:
                pieces = self.gen.stream(ids[0], chat=False, **kw)
                for piece in pieces:
                    yield chunk(piece)
            except ValueError as e:
                raise RequestError(str(e)) from None
        yield chunk("", _FINISH[pieces.finish_reason])


class _Handler(BaseHTTPRequestHandler):
    service: Service  # set on the subclass made by make_server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet by default; errors still reach the client
        pass

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send(status, {"error": {"message": message, "type": kind, "code": status}})

    def do_GET(self):
        if self.path == "/health":
            self._send(200, self.service.info())
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": self.service.model, "object": "model",
                                                          "owned_by": "eagle-jax"}]})
        else:
            self._error(404, f"no route GET {self.path}")

    def do_POST(self):
        routes = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
        kind = routes.get(self.path)
        if kind is None:
            return self._error(404, f"no route POST {self.path}")
        try:
            n = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(n) or b"null")
            except (ValueError, UnicodeDecodeError) as e:
                raise RequestError(f"the request body is not valid JSON: {e}") from None
            if isinstance(body, dict) and body.get("stream"):
                return self._stream(kind, body)
            self._send(200, self.service.run(kind, body))
        except RequestError as e:
            self._error(400, str(e))
        except Exception as e:  # noqa: BLE001 - the client gets the cause, the server keeps running
            self._error(500, f"{type(e).__name__}: {e}")

    def _stream(self, kind: str, body: dict) -> None:
        events = self.service.stream(kind, body)
        first = next(events)  # validation errors surface here, before any bytes are sent
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            for event in _chain(first, events):  # each piece goes out as soon as it is accepted
                self._event(event)
        except Exception as e:  # noqa: BLE001 - headers are out: report it as an event, not a 500
            self._event({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error", "code": 500}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, payload: dict) -> None:
        self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()


def _chain(first, rest):
    yield first
    yield from rest


def make_server(generator, host: str = "127.0.0.1", port: int = 8000, *, model_name: str = "eagle-jax",
                draft_name: str = "none", max_batch: int = 8, batch_window_s: float = 0.005
                ) -> ThreadingHTTPServer:
    """An HTTP server (not yet started: call serve_forever) around `generator`."""
    service = Service(generator, model_name, draft_name, max_batch=max_batch, batch_window_s=batch_window_s)
    handler = type("Handler", (_Handler,), {"service": service})
    return _Server((host, port), handler)


class _Server(ThreadingHTTPServer):
    def server_close(self) -> None:
        super().server_close()
        self.RequestHandlerClass.service.batcher.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    from eagle_jax.cli import add_model_arguments

    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8,
                   help="most prompts batched together across concurrent requests (1 = no batching)")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="how long the oldest waiting request waits for others to batch with")
    add_model_arguments(p)


def main(args) -> int:
    from eagle_jax.cli import generator_from_args

    gen = generator_from_args(args)
    server = make_server(gen, args.host, args.port, model_name=args.target, draft_name=args.draft,
                         max_batch=args.max_batch, batch_window_s=args.batch_window_ms / 1000)
    print(f"eagle-jax serve: http://{args.host}:{server.server_address[1]} "
          f"(target {args.target}, draft {args.draft if gen.speculative else 'none'})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
