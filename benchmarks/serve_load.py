"""Serving under concurrent load, measured as the EAGLE 3.1 release measures it: per-user
output throughput at concurrency 1, 4 and 16, speculative against plain decoding.

    eagle-jax bench --suite serve [--serve-concurrency 1,4,16] [--max-new-tokens 64] [--rounds 2]

Two real HTTP servers (serve/server.py) run in this process on the slot
engine (`--engine slots`, continuous batching) with as many slots as the
highest concurrency: one decodes plainly, one has the drafter (`--draft`,
default the bundled EAGLE 3.1) at every batch size (`disable_by_batch_size=None`,
so the CPU's batch policy does not turn it off) and drafts at the steps its
policy picks by measured cost and acceptance (serve/slots.py `_DraftPolicy`;
the result counts the timed steps by draft depth, 0 being plain). At concurrency c, c clients each POST one greedy chat request
(HumanEval prompts) at the same moment; a user's output throughput is its
completion tokens over its request's wall time, as the client sees it. Rounds
alternate the two servers (odd rounds reversed) after an untimed burst at
every concurrency. Reported per concurrency: the median per-user throughput
of each server, their ratio paired by round, mean latency, and how many
replies of the speculative server are the same text as the plain one's
(greedy: the same except at near-ties).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request

__all__ = ["run"]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read().decode())


def _burst(url: str, bodies: list[dict]) -> dict:
    """Every body POSTed at once; wall time to the last reply, per-request latencies, replies."""
    replies, latency = [None] * len(bodies), [0.0] * len(bodies)
    errors: list[BaseException] = []
    go = threading.Barrier(len(bodies) + 1)

    def client(i):
        go.wait()
        t = time.perf_counter()
        try:
            replies[i] = _post(url, bodies[i])
        except BaseException as e:  # noqa: BLE001 - re-raised below on the main thread
            errors.append(e)
        latency[i] = time.perf_counter() - t

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
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "user_tokens": [r["usage"]["completion_tokens"] for r in replies], "latencies": latency,
            "latency_mean_s": statistics.mean(latency), "latency_max_s": max(latency),
            "batch_sizes": sorted({r["eagle"]["batch_size"] for r in replies}),
            "texts": [r["choices"][0]["message"]["content"] for r in replies]}


def _per_user(burst: dict) -> float:
    """Median over users of completion tokens / request wall time."""
    return statistics.median(t / lat for t, lat in zip(burst["user_tokens"], burst["latencies"]))


def run(args, log) -> dict:
    from eagle_jax.benchmarks import datasets as ds
    from eagle_jax.benchmarks import harness as H
    from eagle_jax.config import SpecConfig
    from eagle_jax.convert.bundled import load_drafter_by_name
    from eagle_jax.convert.registry import load_target
    from eagle_jax.generate import Generator
    from eagle_jax.runtime import default_dtype, enable_compilation_cache
    from eagle_jax.serve.server import make_server

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
                          "engine": "slots", "eagle_drafts": "adaptive"}
    drafter = load_drafter_by_name(draft, target.cfg, args.target, dtype=dtype)
    gens = {"plain": Generator(target.cfg, target.params, target.tokenizer),
            "eagle": Generator(target.cfg, target.params, target.tokenizer, drafter=drafter,
                               spec=SpecConfig(disable_by_batch_size=None))}
    servers, warm = {}, {}
    try:
        for name, gen in gens.items():
            t0 = time.perf_counter()
            servers[name] = make_server(gen, "127.0.0.1", 0, engine="slots", max_batch=levels[-1], max_len=max_len,
                                        warm_prompt_tokens=longest, draft_name=draft if name == "eagle" else "none")
            threading.Thread(target=servers[name].serve_forever, daemon=True).start()
            warm[name] = time.perf_counter() - t0
            log(f"serve {name}: slot engine warm-up {warm[name]:.1f}s")
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
                    log(f"serve {n} concurrency {c} round {i}: {_per_user(timed[n, c][-1]):.1f} tok/s per user")
        result["steps"] = {n: s.engine.info()["steps"] for n, s in servers.items()}
    finally:
        for s in servers.values():
            s.shutdown()
            s.server_close()
    result["warmup_s"] = warm
    result["levels"] = {}
    for c in levels:
        plain, eagle = timed["plain", c], timed["eagle", c]
        result["levels"][str(c)] = {
            "per_user_tokens_per_s": {"plain": statistics.median(map(_per_user, plain)),
                                      "eagle": statistics.median(map(_per_user, eagle))},
            "speedup_paired_median": statistics.median(_per_user(e) / _per_user(p) for p, e in zip(plain, eagle)),
            "latency_mean_s": {"plain": statistics.median(r["latency_mean_s"] for r in plain),
                               "eagle": statistics.median(r["latency_mean_s"] for r in eagle)},
            "same_texts": sum(a == b for p, e in zip(plain, eagle) for a, b in zip(p["texts"], e["texts"])),
            "replies": sum(len(r["texts"]) for r in eagle),
            "batch_sizes": {"plain": sorted({b for r in plain for b in r["batch_sizes"]}),
                            "eagle": sorted({b for r in eagle for b in r["batch_sizes"]})},
            "eagle_steps_by_depth": depths[c],
        }
    return result
