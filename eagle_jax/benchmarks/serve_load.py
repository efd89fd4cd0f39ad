"""Serving under concurrent load, measured as the EAGLE 3.1 release measures it: per-user
output throughput at concurrency 1, 4 and 16, speculative against plain decoding.

    eagle-jax bench --suite serve [--serve-concurrency 1,4,16] [--max-new-tokens 64] [--rounds 2]

Two real HTTP servers (serve/cli.py) run in this process on the
engine (continuous batching) with as many rows as the
highest concurrency: one decodes plainly, one has the drafter (`--draft`,
default the bundled EAGLE 3.1) at every batch size (`disable_by_batch_size=None`,
so the CPU's batch policy does not turn it off) and drafts at the steps its
policy picks by measured cost and acceptance (engine/policy.py `DraftPolicy`;
the result counts the timed steps by draft depth, 0 being plain). At concurrency
c, c clients each POST one streamed greedy chat request (HumanEval prompts,
`stream_options.include_usage`) at the same moment; a user's output throughput
is its completion tokens over its request's wall time, as the client sees it.
Rounds alternate the two servers (odd rounds reversed) after an untimed burst
at every concurrency. Reported per concurrency and server: the median per-user
throughput and the ratio paired by round, total throughput (all tokens of a
burst over its wall time, median over rounds), mean latency, time to first
token and inter-token latency (the gaps between a stream's content chunks, as
`vllm bench serve` takes them: a speculative chunk may hold several tokens)
at p50 and p99 over every request and gap of the timed rounds, and how many
replies of the speculative server are the same text as the plain one's
(greedy: the same except at near-ties).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request

import numpy as np

__all__ = ["run", "per_user"]


def _stream(url: str, body: dict) -> dict:
    """One streamed chat request: its text, completion tokens (from the usage chunk), time to
    the first content chunk, the gaps between content chunks, and its wall time."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    pieces, times, usage = [], [], None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    pieces.append(piece)
                    times.append(time.perf_counter())
    if usage is None or not times:
        raise RuntimeError(f"a stream from {url} ended without content or usage")
    return {"text": "".join(pieces), "tokens": usage["completion_tokens"], "ttft_s": times[0] - t0,
            "gaps": np.diff(times).tolist(), "latency_s": time.perf_counter() - t0}


def _burst(url: str, bodies: list[dict]) -> dict:
    """Every body streamed at once: wall time to the last reply, and each reply's measures."""
    replies: list[dict | None] = [None] * len(bodies)
    errors: list[BaseException] = []
    go = threading.Barrier(len(bodies) + 1)

    def client(i):
        go.wait()
        try:
            replies[i] = _stream(url, bodies[i])
        except BaseException as e:  # noqa: BLE001 - re-raised below on the main thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"wall_s": wall, "tokens_per_s": sum(r["tokens"] for r in replies) / wall, "replies": replies}


def per_user(burst: dict) -> float:
    """Median over users of completion tokens / request wall time."""
    return statistics.median(r["tokens"] / r["latency_s"] for r in burst["replies"])


def _percentiles(values: list[float]) -> dict:
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))} if values else {}


def run(args, log) -> dict:
    from eagle_jax.benchmarks import datasets as ds
    from eagle_jax.benchmarks import harness as H
    from eagle_jax.config import SpecConfig
    from eagle_jax.convert.bundled import load_drafter_by_name
    from eagle_jax.convert.registry import load_target
    from eagle_jax.generate import Generator
    from eagle_jax.runtime import default_dtype, enable_compilation_cache
    from eagle_jax.serve.app import make_server

    levels = sorted({int(c) for c in args.serve_concurrency.split(",")})
    if not levels or levels[0] < 1:
        raise SystemExit(f"--serve-concurrency must list positive integers, got {args.serve_concurrency!r}")
    max_new = args.max_new_tokens or 64
    rounds = args.rounds or 2
    if len(args.draft) > 1:
        raise SystemExit("--suite serve measures one drafter: pass at most one --draft")
    draft = args.draft[0] if args.draft else "default"
    result = H.result_header("serve")
    result["mode"] = "concurrency"
    enable_compilation_cache()
    dtype = args.dtype or default_dtype()
    target = load_target(args.target, dtype=dtype)
    prompts = ds.build_suite(target.tokenizer, humaneval=levels[-1])["humaneval"]
    bodies = [{"messages": [{"role": "user", "content": p.text}], "max_tokens": max_new} for p in prompts]
    longest = max(len(target.tokenizer.apply_chat(b["messages"])) for b in bodies)
    max_len = 64 * -(-(longest + max_new + 64) // 64)
    result["settings"] = {"concurrency": levels, "max_new_tokens": max_new, "rounds": rounds, "slots": levels[-1],
                          "max_len": max_len, "dataset": "humaneval", "temperature": 0.0, "draft": draft,
                          "engine": "slots", "prefill_chunk": args.prefill_chunk,
                          "prefill_budget": args.prefill_budget, "eagle_drafts": "adaptive"}
    drafter = load_drafter_by_name(draft, target.cfg, args.target, dtype=dtype)
    gens = {"plain": Generator(target.cfg, target.params, target.tokenizer),
            "eagle": Generator(target.cfg, target.params, target.tokenizer, drafter=drafter,
                               spec=SpecConfig(disable_by_batch_size=None))}
    servers, warm = {}, {}
    try:
        for name, gen in gens.items():
            t0 = time.perf_counter()
            servers[name] = make_server(gen, "127.0.0.1", 0, max_batch=levels[-1], max_len=max_len,
                                        prefill_chunk=args.prefill_chunk, prefill_budget=args.prefill_budget,
                                        draft_name=draft if name == "eagle" else "none")
            threading.Thread(target=servers[name].serve_forever, daemon=True).start()
            warm[name] = time.perf_counter() - t0
            log(f"serve {name}: engine warm-up {warm[name]:.1f}s")
        urls = {n: f"http://127.0.0.1:{s.server_address[1]}" for n, s in servers.items()}
        for c in levels:  # untimed: anything left to compile at a new concurrency
            for url in urls.values():
                _burst(url, bodies[:c])
        timed = {(n, c): [] for n in urls for c in levels}
        depths = {c: {} for c in levels}  # the EAGLE server's timed steps by draft depth (0: plain)
        for i in range(rounds):
            for c in levels:
                for n in (list(urls) if i % 2 == 0 else list(urls)[::-1]):
                    before = servers[n].engine.info()["steps"]
                    timed[n, c].append(_burst(urls[n], bodies[:c]))
                    if n == "eagle":
                        for d, k in servers[n].engine.info()["steps"].items():
                            depths[c][d] = depths[c].get(d, 0) + k - before.get(d, 0)
                    log(f"serve {n} concurrency {c} round {i}: {per_user(timed[n, c][-1]):.1f} tok/s per user")
        result["steps"] = {n: s.engine.info()["steps"] for n, s in servers.items()}
    finally:
        for s in servers.values():
            s.shutdown()
            s.server_close()
    result["warmup_s"] = warm
    result["levels"] = {}
    for c in levels:
        plain, eagle = timed["plain", c], timed["eagle", c]
        both = {"plain": plain, "eagle": eagle}
        replies = {n: [r for b in bursts for r in b["replies"]] for n, bursts in both.items()}
        result["levels"][str(c)] = {
            "per_user_tokens_per_s": {n: statistics.median(map(per_user, b)) for n, b in both.items()},
            "speedup_paired_median": statistics.median(per_user(e) / per_user(p) for p, e in zip(plain, eagle)),
            "total_tokens_per_s": {n: statistics.median(x["tokens_per_s"] for x in b) for n, b in both.items()},
            "latency_mean_s": {n: statistics.mean(r["latency_s"] for r in rs) for n, rs in replies.items()},
            "ttft_s": {n: _percentiles([r["ttft_s"] for r in rs]) for n, rs in replies.items()},
            "itl_s": {n: _percentiles([g for r in rs for g in r["gaps"]]) for n, rs in replies.items()},
            "same_texts": sum(a["text"] == b["text"] for a, b in zip(replies["plain"], replies["eagle"])),
            "replies": len(replies["eagle"]),
            "eagle_steps_by_depth": depths[c],
        }
    return result
