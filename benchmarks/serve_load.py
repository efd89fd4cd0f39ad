"""Serving under concurrent load: cross-request batching against one request at a time.

    eagle-jax bench --suite serve [--serve-clients 8] [--max-new-tokens 64] [--rounds 2]

For plain decoding and for the bundled EAGLE 3.1 drafter (the `serve`
default), the real HTTP server (serve/server.py) runs on this process's
Generator twice: with `--max-batch 1` (requests queue one behind another)
and with `--max-batch N` (N = the number of clients). N clients each POST one
greedy chat request (HumanEval prompts) at the same moment; a round times
until the last reply. Rounds alternate the two servers (odd rounds reversed)
after an untimed warm-up that compiles both. Reported: total tokens/s, mean
and worst request latency, the batch sizes the replies report, the ratio
batched / unbatched within the same round, and whether the batched replies
are the same text as the unbatched ones.

This is static batching's best case: greedy requests with the same
max_tokens that arrive together. A round whose requests split into more than
one batch may include a compile of the new shape; the batch sizes each round
saw are recorded so such rounds can be told apart.
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
            "latency_mean_s": statistics.mean(latency), "latency_max_s": max(latency),
            "batch_sizes": sorted({r["eagle"]["batch_size"] for r in replies}),
            "texts": [r["choices"][0]["message"]["content"] for r in replies]}


def run(args, log) -> dict:
    from eagle_jax.benchmarks import datasets as ds
    from eagle_jax.benchmarks import harness as H
    from eagle_jax.convert.bundled import load_drafter_by_name
    from eagle_jax.convert.registry import load_target
    from eagle_jax.generate import Generator
    from eagle_jax.runtime import default_dtype, enable_compilation_cache
    from eagle_jax.serve.server import make_server

    clients = args.serve_clients
    max_new = args.max_new_tokens or 64
    rounds = args.rounds or 2
    result = H.result_header("serve")
    result["mode"] = "load"
    result["settings"] = {"clients": clients, "max_new_tokens": max_new, "rounds": rounds,
                          "batch_window_ms": args.batch_window_ms, "dataset": "humaneval", "temperature": 0.0}
    enable_compilation_cache()
    dtype = args.dtype or default_dtype()
    target = load_target(args.target, dtype=dtype)
    prompts = ds.build_suite(target.tokenizer, humaneval=clients)["humaneval"]
    bodies = [{"messages": [{"role": "user", "content": p.text}], "max_tokens": max_new} for p in prompts]
    if len(args.draft) > 1:
        raise SystemExit("--suite serve measures one drafter: pass at most one --draft")
    draft = args.draft[0] if args.draft else "default"
    engines = {"plain": None, f"EAGLE ({draft})": load_drafter_by_name(draft, target.cfg, args.target, dtype=dtype)}
    result["engines"] = {}
    for name, drafter in engines.items():
        gen = Generator(target.cfg, target.params, target.tokenizer, drafter=drafter)
        servers = {mb: make_server(gen, "127.0.0.1", 0, max_batch=mb, batch_window_s=args.batch_window_ms / 1000)
                   for mb in (1, clients)}
        for s in servers.values():
            threading.Thread(target=s.serve_forever, daemon=True).start()
        urls = {mb: f"http://127.0.0.1:{s.server_address[1]}" for mb, s in servers.items()}
        try:
            t0 = time.perf_counter()
            for mb in urls:  # warm-up: compiles batch 1 and the padded batch
                _burst(urls[mb], bodies)
            warm_s = time.perf_counter() - t0
            log(f"serve {name}: warm-up {warm_s:.1f}s")
            timed = {mb: [] for mb in urls}
            for i in range(rounds):
                order = list(urls) if i % 2 == 0 else list(urls)[::-1]
                for mb in order:
                    timed[mb].append(_burst(urls[mb], bodies))
                    log(f"serve {name} max_batch {mb} round {i}: {timed[mb][-1]['tokens_per_s']:.1f} tok/s")
        finally:
            for s in servers.values():
                s.shutdown()
                s.server_close()
        one, many = timed[1], timed[clients]
        ratios = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(one, many)]
        same = sum(a["texts"] == b["texts"] for a, b in zip(one, many))
        result["engines"][name] = {
            "warmup_s": warm_s,
            "unbatched": [{k: v for k, v in r.items() if k != "texts"} for r in one],
            "batched": [{k: v for k, v in r.items() if k != "texts"} for r in many],
            "tokens_per_s_unbatched": statistics.median(r["tokens_per_s"] for r in one),
            "tokens_per_s_batched": statistics.median(r["tokens_per_s"] for r in many),
            "latency_mean_s_unbatched": statistics.median(r["latency_mean_s"] for r in one),
            "latency_mean_s_batched": statistics.median(r["latency_mean_s"] for r in many),
            "speedup_paired_median": statistics.median(ratios),
            "same_texts_rounds": same,
            "split_rounds": sum(r["batch_sizes"] != [clients] for r in many),
        }
    return result
