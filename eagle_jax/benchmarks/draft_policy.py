"""The engine's draft policy against every fixed draft depth, without HTTP.

    eagle-jax bench --suite draft-policy [--serve-concurrency 1,4,16] [--max-new-tokens 64] [--rounds 3]

One process holds one engine (eagle_jax/engine/) per way of drafting, each
over the same target with as many rows as the highest concurrency: `plain`
(no drafter), `adaptive` (the depth of each step picked by `DraftPolicy`, as
`eagle-jax serve` runs by default) and `depth d` (`adaptive=False`: every step
drafts d tokens, for each depth the adaptive engine compiles: 1, 2, 4, ...
and the drafter's configured depth). The drafter runs at every batch size
(`disable_by_batch_size=None`). At concurrency c, c greedy HumanEval chats
are submitted at once; a user's throughput is its completion tokens over its
request's wall time (`Done.wall_s`, arrival to end). Each round runs every
engine at every concurrency, the engines in a rotated order, after one
untimed burst each. Reported per concurrency and engine: the median per-user
tok/s over rounds, its ratio to plain paired by round (median), the engine's
timed steps by draft depth (0: plain) and catch-up calls, and how many
replies have plain's text (greedy: all but near-ties); and the adaptive
engine's warm-up step times (`info()["step_ms"]`), what its policy weighs.

What it answers: whether the policy is at least as fast as the best fixed
depth at each load, with the HTTP layer and the clients out of the timings.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter

__all__ = ["run"]


async def _reply(req) -> dict:
    """A request's text and its Done's counts and times."""
    from eagle_jax.engine import Delta

    text = ""
    async for event in req.events():
        if isinstance(event, Delta):
            text += event.text
        else:
            return {"text": text, "tokens": event.completion_tokens, "latency_s": event.wall_s}
    raise RuntimeError("a request ended without its Done")


def _burst(engine, prompts: list[list[int]], max_new: int) -> dict:
    """Every prompt submitted at once; each reply, the burst's wall time, and the engine's steps
    by depth and catch-up calls during it."""
    from eagle_jax.engine import Sampling

    async def all_of():
        reqs = [engine.submit(ids, Sampling(max_new_tokens=max_new)) for ids in prompts]
        return await asyncio.gather(*map(_reply, reqs))

    before = engine.info()
    t0 = time.perf_counter()
    replies = asyncio.run(all_of())
    wall = time.perf_counter() - t0
    after = engine.info()
    steps = {d: n - before["steps"].get(d, 0) for d, n in after["steps"].items() if n > before["steps"].get(d, 0)}
    return {"wall_s": wall, "replies": replies, "steps": steps, "catch_ups": after["catch_ups"] - before["catch_ups"]}


def run(args, log) -> dict:
    from eagle_jax.benchmarks import datasets as ds
    from eagle_jax.benchmarks import harness as H
    from eagle_jax.benchmarks.serve_load import per_user
    from eagle_jax.config import SpecConfig
    from eagle_jax.convert.bundled import load_drafter_by_name
    from eagle_jax.convert.registry import load_target
    from eagle_jax.generate import Generator
    from eagle_jax.runtime import default_dtype, enable_compilation_cache
    from eagle_jax.engine import Engine, draft_depths, fitting_max_len

    levels = sorted({int(c) for c in args.serve_concurrency.split(",")})
    if not levels or levels[0] < 1:
        raise SystemExit(f"--serve-concurrency must list positive integers, got {args.serve_concurrency!r}")
    max_new, rounds = args.max_new_tokens or 64, args.rounds or 3
    if len(args.draft) > 1:
        raise SystemExit("--suite draft-policy measures one drafter: pass at most one --draft")
    draft = args.draft[0] if args.draft else "default"
    enable_compilation_cache()
    dtype = args.dtype or default_dtype()
    target = load_target(args.target, dtype=dtype)
    drafter = load_drafter_by_name(draft, target.cfg, args.target, dtype=dtype)
    if drafter is None:
        raise SystemExit(f"--suite draft-policy needs a drafter; {draft!r} names none for {args.target}")
    tok = target.tokenizer
    prompts = [tok.apply_chat(p.text) for p in ds.build_suite(tok, humaneval=levels[-1])["humaneval"]]
    spec = SpecConfig(disable_by_batch_size=None)
    plain = Generator(target.cfg, target.params, tok)
    eagle = Generator(target.cfg, target.params, tok, drafter=drafter, spec=spec)
    max_len = fitting_max_len(eagle, max(map(len, prompts)), max_new, args.prefill_chunk)
    kw = dict(max_rows=levels[-1], max_len=max_len, prefill_chunk=args.prefill_chunk, prefill_budget=args.prefill_budget)
    engines, warm = {}, {}
    ways = [("plain", plain, {"speculative": False}), ("adaptive", eagle, {"draft_name": draft})]
    ways += [(f"depth {d}", Generator(target.cfg, target.params, tok, drafter=drafter, spec=spec.at_depth(d)),
              {"draft_name": draft, "adaptive": False}) for d in draft_depths(spec.depth)]
    result = H.result_header("draft_policy")
    result["mode"] = "engines"
    result["settings"] = {"concurrency": levels, "max_new_tokens": max_new, "rounds": rounds, "draft": draft,
                          "dataset": "humaneval", "temperature": 0.0, "deepest": spec.depth, **kw}
    try:
        for name, gen, extra in ways:
            t0 = time.perf_counter()
            engines[name] = Engine(gen, **kw, **extra)
            warm[name] = time.perf_counter() - t0
            log(f"draft-policy {name}: warm-up {warm[name]:.1f}s")
        for c in levels:  # untimed
            for engine in engines.values():
                _burst(engine, prompts[:c], max_new)
        timed = {(n, c): [] for n in engines for c in levels}
        for i in range(rounds):
            order = list(engines)[i % len(engines):] + list(engines)[:i % len(engines)]
            for c in levels:
                for name in order:
                    timed[name, c].append(_burst(engines[name], prompts[:c], max_new))
                    log(f"draft-policy {name} concurrency {c} round {i}: "
                        f"{per_user(timed[name, c][-1]):.1f} tok/s per user")
    finally:
        for engine in engines.values():
            engine.close()
    result["warmup_s"] = warm
    result["adaptive_step_ms"] = engines["adaptive"].info()["step_ms"]
    result["levels"] = {}
    for c in levels:
        base = timed["plain", c]
        texts = [r["text"] for b in base for r in b["replies"]]
        result["levels"][str(c)] = {name: {
            "per_user_tokens_per_s": statistics.median(map(per_user, bursts)),
            "vs_plain_paired_median": statistics.median(per_user(b) / per_user(p) for p, b in zip(base, bursts)),
            "steps_by_depth": dict(sorted(sum((Counter(b["steps"]) for b in bursts), Counter()).items())),
            "catch_ups": sum(b["catch_ups"] for b in bursts),
            "same_texts_as_plain": sum(a == r["text"] for a, r in zip(texts, (r for b in bursts for r in b["replies"]))),
            "replies": len(texts),
        } for name in engines for bursts in [timed[name, c]]}
    return result
