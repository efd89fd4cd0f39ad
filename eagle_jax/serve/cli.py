"""`eagle-jax serve`: an OpenAI-compatible HTTP server around one decoding engine.

    eagle-jax serve --port 8000                       # SmolLM2 + its bundled EAGLE 3.1 drafter
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Endpoints:
  GET  /health                  {"status": "ok", "model", "draft", "method", ...}  (names, never paths)
  GET  /v1/models, /v1/models/{id}   the one model (any other id: 404)
  POST /v1/completions          {"prompt": str | [str] | [ids] | [[ids]], ...}  raw text, no chat template
  POST /v1/chat/completions     {"messages": [{role, content: str | [text parts]}], ...}  chat template
  GET  /metrics                 Prometheus text, vLLM's metric names (serve/metrics.py)

Request fields: model (omitted or this server's name, else 404), max_tokens /
max_completion_tokens (the latter wins; default --default-max-tokens),
temperature (default 0 = greedy), top_p, top_k (0 or -1 = off), seed (default:
a random one), stop (a string or a list), stream, stream_options.include_usage
(a last chunk with `usage` and no choices), user. `n` must be 1; `logprobs`,
penalties, `logit_bias`, `echo`, `suffix` and `best_of` are refused with a 400
naming the field rather than ignored; so is any unknown field. Responses carry
`usage` and an `eagle` block (acceptance, tokens/s, batch size, queue time).

Errors are OpenAI's `{"error": {"message", "type", "param", "code"}}` with a 4xx
for every bad input: 400 for bad JSON, invalid UTF-8, lone surrogates, NaN or
Infinity, nesting past 32 levels, bad fields, prompts or limits; 401 for a
missing or wrong API key (`--api-key`, or $EAGLE_JAX_API_KEY: `Authorization:
Bearer KEY` on /v1/*); 404 for an unknown model or route; 408 for a body that
does not arrive within --body-timeout-s; 413 for a body over --max-body-bytes,
refused from its Content-Length before it is read. A request the HTTP parser
cannot read gets a JSON error that says what was wrong: 400 for a garbage request
line or header, a bad Content-Length or chunk size; 431 for headers still
incomplete past 16 KiB; 501 for a Transfer-Encoding other than chunked. 408 for
request headers that have not all arrived --header-timeout-s after the connection
opened or the previous response ended (an idle connection is just closed); 503 for
a request on a connection opened while --max-connections were open (it is then
closed); 415 for a POST whose Content-Type is not application/json (a web page's simple
cross-origin request cannot drive the server). A field sent as null takes its
default. Messages' `tool_calls` / `tool_call_id` and `tools` reach a chat
template that renders tool calls, else a 400 says tools are not supported.
A client that disconnects cancels its request (its row ends at the next step)
and is reported in one console line; one that half-closes after a whole request
gets its answer. SIGTERM drains (--shutdown-timeout) and exits 0.

Across hosts (`--mesh` over every process's devices, `--num-processes N --process-id I
--coordinator-address HOST:PORT`, the same command in each process): process 0 serves HTTP and
runs the scheduler; the others serve nothing and make process 0's engine calls in the same order
(eagle_jax/engine/lockstep.py), so that every SPMD step runs on every host.

Stack: FastAPI (Starlette) on uvicorn rather than aiohttp, by fit: it is what
the OpenAI-compatible peers run (vLLM, SGLang), its pydantic models check the
request bodies, streaming responses cancel on disconnect, and uvicorn takes a
socket bound beforehand (a busy port is one line, before the model loads).
aiohttp was not measured against it: the HTTP layer is not what limits
throughput here. Measured with an engine that returns at once, a chat request
spends 2.7 ms (p50; p99 9.5 ms) in this layer on one loaded core, against
seconds on the engine.

The engine behind the HTTP layer is anything with the engine's interface
(submit / events / cancel / load / check / info); the server runs
eagle_jax/engine/'s `Engine` (continuous batching over `--max-batch` rows,
every program compiled at start-up).
serve/app.py holds the HTTP layer; this module (the command line) imports no web
framework until a server is made.
"""

from __future__ import annotations

import argparse
import logging
import os

from eagle_jax.cli.args import add_model_arguments, add_multihost_arguments, generator_from_args, join_processes
from eagle_jax.serve.limits import Limits, PortInUse, bind
from eagle_jax.sharding import parse_mesh

__all__ = ["add_arguments", "main", "short_name"]


# ---------------------------------------------------------------------------- the command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Limits()
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="0: any free port (the start-up line names it)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="rows: most requests decoded together (continuous batching, eagle_jax/engine/)")
    p.add_argument("--max-len", type=int, default=1024,
                   help="cache slots per row: prompt and answer (and a step's scratch) together")
    p.add_argument("--prefill-chunk", type=int, default=64,
                   help="prompt tokens prefilled a call (one program for every prompt length)")
    p.add_argument("--prefill-budget", type=int, default=256,
                   help="most prompt tokens prefilled between two steps while rows decode "
                        "(0: every waiting prompt before the next step)")
    p.add_argument("--fixed-draft-depth", action="store_true",
                   help="draft at the configured depth at every step that speculates, rather than at the depth "
                        "(down to plain) that measured step costs and acceptance favour")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --target's name, or its file or directory's "
                        "base name: never a path)")
    p.add_argument("--api-key", default=os.environ.get("EAGLE_JAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $EAGLE_JAX_API_KEY, else none)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=30.0, metavar="S",
                   help="on SIGTERM: accept no new connections, let requests in flight finish for up to S "
                        "seconds, end the rest (a stream's last chunk says abort; an answer is a 503), exit 0")
    p.add_argument("--max-connections", type=_count, default=d.max_connections, metavar="N",
                   help="open connections at most: a request on one more gets a 503 and its connection is closed")
    p.add_argument("--header-timeout-s", type=_timeout, default=d.header_timeout_s, metavar="S",
                   help="a request's headers must all arrive within S seconds of its connection's opening (or of "
                        "the previous response), else a 408 and the connection is closed")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s,
                   help="a request body must arrive within this time (else 408)")
    p.add_argument("--max-tokens-limit", type=int, default=d.max_tokens, help="largest max_tokens accepted")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                   help="max_tokens of a request that sets none")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt accepted, in tokens (default: what the context leaves room for)")
    add_model_arguments(p)
    add_multihost_arguments(p, "process 0 serves HTTP and schedules, the others make its engine calls")


def _port(s: str) -> int:
    """A TCP port, 0..65535 (0: any free one)."""
    if not (s.isascii() and s.isdigit()) or int(s) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {s!r}")
    return int(s)


def _count(s: str) -> int:
    """A whole number >= 1."""
    if not (s.isascii() and s.isdigit()) or int(s) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {s!r}")
    return int(s)


def _timeout(s: str) -> float:
    """A time in seconds, > 0."""
    t = _seconds(s)
    if t == 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {s!r}")
    return t


def _seconds(s: str) -> float:
    """A time in seconds, >= 0."""
    try:
        t = float(s)
    except ValueError:
        t = -1.0
    if not 0 <= t < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {s!r}")
    return t


def main(args) -> int:
    if args.api_key is not None and (not args.api_key or args.api_key != args.api_key.strip()):
        print("eagle-jax serve: error: the API key (--api-key or $EAGLE_JAX_API_KEY) is empty or begins or ends "
              "with whitespace: no client could send it; unset it to serve without a key", flush=True)
        return 1
    data = parse_mesh(args.mesh).data if args.mesh else 1
    if args.max_batch < 1 or args.max_batch % data:
        print(f"eagle-jax serve: error: --max-batch must be a positive multiple of the mesh's data axis ({data}): "
              f"each data shard holds as many rows; got {args.max_batch}", flush=True)
        return 1
    if not join_processes(args, args.mesh):  # a process other than 0: no HTTP, it follows process 0's engine
        return _follow(args)
    try:
        sock = bind(args.host, args.port)  # before loading: a busy port fails in a second
    except PortInUse as e:
        print(f"eagle-jax serve: error: {e}", flush=True)
        return 1
    _console_log()
    try:
        from eagle_jax.serve.app import make_server as make
    except ModuleNotFoundError as e:
        print(f"eagle-jax serve: error: {e.name} is missing: pip install 'eagle-jax[serve]'", flush=True)
        return 1
    gen = generator_from_args(args)
    limits = Limits(max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s,
                    max_tokens=args.max_tokens_limit, default_max_tokens=args.default_max_tokens,
                    max_prompt_tokens=args.max_prompt_tokens, header_timeout_s=args.header_timeout_s,
                    max_connections=args.max_connections)
    name = args.served_model_name or short_name(args.target)
    server = make(gen, model_name=name, draft_name=short_name(args.draft), max_batch=args.max_batch,
                  max_len=args.max_len, prefill_chunk=args.prefill_chunk, prefill_budget=args.prefill_budget,
                  adaptive=not args.fixed_draft_depth, limits=limits,
                  api_key=args.api_key, sock=sock, shutdown_timeout_s=args.shutdown_timeout)
    host, port = server.server_address
    print(f"eagle-jax serve: http://{host}:{port} (model {name!r}, draft "
          f"{server.engine.info()['draft']}{', API key required' if args.api_key else ''})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _follow(args) -> int:
    """Process > 0 of a multi-process server: the engine process 0 makes (the same settings, so
    the same programs), following its calls until it closes (eagle_jax/engine/lockstep.py)."""
    from eagle_jax.engine import Engine

    engine = Engine(generator_from_args(args), max_rows=args.max_batch, max_len=args.max_len,
                    draft_name=short_name(args.draft), prefill_chunk=args.prefill_chunk,
                    prefill_budget=args.prefill_budget, adaptive=not args.fixed_draft_depth)
    print(f"eagle-jax serve: process {args.process_id} follows process 0's engine", flush=True)
    engine.follow()
    return 0


def short_name(model: str) -> str:
    """A registered name or hub id as given; a path as its base name, less a checkpoint
    extension (nothing served names a local path)."""
    if not os.path.exists(model):
        return model
    base = os.path.basename(os.path.normpath(model))
    stem, ext = os.path.splitext(base)
    return stem if ext.lower() in (".gguf", ".safetensors") else base


def _console_log() -> None:
    """One line per event on stderr: this server's and uvicorn's warnings, no access log."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("eagle-jax serve: %(message)s"))
    for name in ("eagle_jax.serve", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False
