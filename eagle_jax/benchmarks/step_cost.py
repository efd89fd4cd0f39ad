"""Step cost: what one target forward, one drafter step and one decoding step cost.

    eagle-jax bench --suite step-cost [--quick] [--dtype bfloat16,float32]
    python -m eagle_jax.benchmarks.step_cost --quick

Measured in one run, each as a ratio to a baseline of the same run:

* `bandwidth`: the machine's streaming bandwidth (an XLA `x + 1` over 256 MiB,
  bytes read + written per second), and from it the *bandwidth floor* of a
  decode step: the bytes of the target's weights (its packed lm_head
  included) over that bandwidth.
* `forward`: the engine's real target forward (`Target` call + logits on
  the parameters `Generator` decodes with, 8 forwards in one jitted loop, a
  committed context of `context` tokens) over M = 1, 2, 3, 5, 8, 12, 16, 32 new tokens per row,
  batch 1 and 4; median ms, ratio to M = 1 and to the floor. Plus M = 1 at a
  long context (`long_context`), the KV bytes a plain step must read.
* `compute`: the marginal cost of a row between the two largest M (where
  the forward is compute bound), and the least cost of M rows relative to
  M = 1 that it implies once M = 1 runs at the bandwidth floor.
* `drafter`: one drafter step (T = 1, a chain step; T = top_k, a tree level)
  and the feature projection, against a target M = 1 forward.
* `steps`: whole decoding steps from `Generator.generate` (plain, chain k,
  the default tree; greedy, one prompt, warm): steady-state ms per step =
  (wall - TTFT) / steps, median of interleaved rounds, and spec step /
  plain step; tokens/s over the decode phase (prefill excluded), so the
  speedup is beside the step ratio.
* `breakdown`: a `jax.profiler` trace of those runs, XLA op time per named
  scope of the step (spec_decode/loop.py: target, draft, accept, commit, drafter),
  in ms per step.
* `batched`: decode tokens/s with 16 rows against 1 row (plain, greedy).

Results: benchmarks/results/step-cost-<date>-<machine>.json and a section
of docs/benchmarks.md (with a plot of forward cost against M).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import tempfile
import time

FORWARD_M = (1, 2, 3, 5, 8, 12, 16, 32)
PROMPT = "Write a Python function that returns the list of prime numbers below n, with a docstring."
SCOPES = ("target", "draft", "accept", "commit", "drafter")


def _median_ms(fn, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compile / warm
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def bandwidth_gbps(repeats: int = 7) -> float:
    """Bytes read + written per second by XLA's `x + 1` over 256 MiB of f32."""
    import jax
    import jax.numpy as jnp

    holder = {"x": jnp.zeros((64 << 20,), jnp.float32)}
    nbytes = holder["x"].nbytes
    f = jax.jit(lambda x: x + 1.0, donate_argnums=0)  # in place: no fresh pages to fault in

    def call():
        holder["x"] = f(holder["x"])
        return holder["x"]

    ms = _median_ms(call, repeats)
    return 2 * nbytes / (ms / 1e3) / 1e9


def _param_bytes(tree) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(tree))


def weight_bytes(params) -> int:
    """What one decode step streams: every weight but the embedding table
    (one row of it is read), the lm_head counted once."""
    return _param_bytes({k: v for k, v in params.items() if k != "embed"})


def forward_loop(gen, inner: int):
    """A fresh jitted (params, cache, tok [B, M], pos [B, M]) -> (cache, acc [B]):
    `inner` target forwards + logits in one `fori_loop` (as the decoding loop
    runs them: no per-call dispatch), the cache donated, the last row's first
    logit summed so nothing is dead."""
    import jax
    import jax.numpy as jnp

    from eagle_jax.models import target

    cfg = gen.target_cfg

    def many(params, cache, tok, pos):
        def body(_, carry):
            cache, acc = carry
            model = target.Target(cfg, params)
            h, cache, _ = model(tok, pos, cache, impl=gen.impl)
            return cache, acc + model.logits(h, impl=gen.impl)[:, -1, 0]
        return jax.lax.fori_loop(0, inner, body, (cache, jnp.zeros((tok.shape[0],), jnp.float32)))

    return jax.jit(many, donate_argnums=1)


def forward_costs(gen, ms: tuple[int, ...], batch: int, context: int, repeats: int, inner: int = 8) -> dict[int, float]:
    """Median ms of one target forward + logits over m new tokens per row, from
    `inner` forwards in one jitted `fori_loop` (`forward_loop`), each at the
    same committed context."""
    import jax.numpy as jnp

    from eagle_jax.models import target

    cfg, params = gen.target_cfg, gen.target_params
    f = forward_loop(gen, inner)
    dtype = params["embed"].dtype
    out = {}
    for m in ms:
        holder = {"cache": target.create_cache(cfg, batch, context + 64 + max(ms), dtype).replace(
            lengths=jnp.full((batch,), context, jnp.int32))}
        tok = jnp.full((batch, m), 42, jnp.int32)
        pos = context + jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (batch, m))

        def call():
            holder["cache"], acc = f(params, holder["cache"], tok, pos)
            return acc

        out[m] = _median_ms(call, repeats) / inner
    return out


def drafter_costs(gen, context: int, repeats: int) -> dict:
    """Median ms of one drafter step at T = 1 and T = top_k, and of the FC projection."""
    import jax
    import jax.numpy as jnp

    from eagle_jax.models import drafter

    dcfg, dparams = gen.drafter_cfg, gen.drafter_params
    embed = gen.target_params["embed"]
    dtype = embed.dtype
    out = {}
    for t in sorted({1, gen.spec.top_k}):
        cache = drafter.create_cache(dcfg, 1, context + 64, dtype).replace(lengths=jnp.array([context], jnp.int32))
        tok = jnp.full((1, t), 42, jnp.int32)
        hid = jnp.full((1, t, dcfg.hidden_size), 0.1, dtype)
        pos = jnp.full((1, t), context, jnp.int32)
        f = jax.jit(lambda p, c, tok=tok, hid=hid, pos=pos: drafter.Drafter(dcfg, p).step(
            tok, hid, pos, c, embed=embed, impl=gen.impl)[0])
        out[f"step_T{t}"] = _median_ms(lambda: f(dparams, cache), repeats)
    aux = jnp.full((1, gen.spec.depth + 1, dcfg.fc_in_size), 0.1, dtype)
    fp = jax.jit(lambda p: drafter.Drafter(dcfg, p).project_features(aux, impl=gen.impl))
    out["project_features"] = _median_ms(lambda: fp(dparams), repeats)
    out["weight_bytes"] = _param_bytes({k: v for k, v in dparams.items() if k != "embed"})
    return out


def steady_steps(engines: dict, max_new: int, rounds: int) -> dict:
    """Warm generate runs, engines interleaved round by round: median ms per
    decoding step ((wall - TTFT) / steps), tokens/s and tau per engine."""
    for g in engines.values():  # compile (or load from the persistent cache) and warm
        g.generate([PROMPT], max_new_tokens=max_new)
    runs = {name: [] for name in engines}
    for i in range(rounds):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        for name in order:
            r = engines[name].generate([PROMPT], max_new_tokens=max_new)
            steps = r.stats.get("num_verify_steps") or (r.num_generated - 1)
            runs[name].append({"ms_per_step": 1e3 * (r.wall_s - r.ttft_s) / max(steps, 1), "steps": steps,
                               "tokens_per_s": r.num_generated / (r.wall_s - r.ttft_s),
                               "tau": r.stats.get("acceptance_length"), "tokens": r.token_ids[0]})
    out = {}
    for name, rs in runs.items():
        med = statistics.median(x["ms_per_step"] for x in rs)
        out[name] = {"ms_per_step": med, "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                     "steps": rs[0]["steps"], "tau": rs[0]["tau"], "tokens": rs[0]["tokens"],
                     "ms_per_step_runs": [x["ms_per_step"] for x in rs]}
    return out


def _trace_scopes(gen, max_new: int) -> dict:
    """XLA op time per named scope of the decoding loop, ms per step, from a profiler trace."""
    import jax

    gen.generate([PROMPT], max_new_tokens=max_new)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            r = gen.generate([PROMPT], max_new_tokens=max_new)
        files = glob.glob(f"{d}/**/*.json.gz", recursive=True)
        events = json.load(gzip.open(files[0]))["traceEvents"]
    steps = r.stats.get("num_verify_steps") or (r.num_generated - 1)
    # Op names -> scope, from the compiled loop's HLO metadata.
    from eagle_jax.spec_decode import loop
    from eagle_jax.engine.batch import batch_inputs

    ids = gen.encode_prompts([PROMPT])
    lc, args, static = batch_inputs(gen, ids, gen.requests(len(ids), max_new_tokens=max_new))
    state = loop.prefill_jit(gen.target_params, gen.drafter_params, gen.vocab, *args, **static)
    hlo = loop.run_jit.lower(gen.target_params, gen.drafter_params, gen.vocab, state, lc=lc).compile().as_text()
    scope_of = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = .*?op_name=\"([^\"]*)\"", line)
        if m and "/while/body/" in m.group(2):
            first = m.group(2).split("/while/body/", 1)[1].split("/")[0]
            scope_of[m.group(1)] = first if first in SCOPES else "other"
    total = collections.Counter()
    for e in events:  # op names repeat across executables: keep the loop's own
        if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == "jit_run" and e.get("name") in scope_of:
            total[scope_of[e["name"]]] += e["dur"]
    return {k: v / 1e3 / max(steps, 1) for k, v in sorted(total.items())}


def batched_throughput(gen, rows: int, max_new: int, repeats: int) -> float:
    """Decode tokens/s of plain greedy decoding with `rows` active rows."""
    best = 0.0
    prompts = [PROMPT] * rows
    for _ in range(repeats + 1):
        r = gen.generate(prompts, max_new_tokens=max_new)
        decode_s = r.wall_s - r.ttft_s
        best = max(best, rows * (max_new - 1) / decode_s)
    return best


def compute_bound(costs: dict, floor_ms: float) -> dict:
    """The compute rate from the forward costs (batch 1): the marginal cost of a row between the
    two largest M measured, where the forward is compute bound, and what it implies for a
    forward whose M = 1 cost sits at the bandwidth floor: M rows cost at least
    max(floor, M x per-row cost), i.e. that over the floor times the M = 1 cost."""
    ms = sorted(int(m) for m in costs)
    lo, hi = ms[-2], ms[-1]
    per_row = (costs[str(hi)]["ms"] - costs[str(lo)]["ms"]) / (hi - lo)
    return {"ms_per_row": per_row, "from_m": [lo, hi],
            "vs_m1_at_floor": {str(m): max(floor_ms, m * per_row) / floor_ms for m in (5, 8, 12, 16)}}


def run(dtypes=("bfloat16", "float32"), *, quick: bool = False, target: str = "smollm2-135m-instruct",
        context: int = 256, long_context: int = 4096, repeats: int = 9, log=print) -> dict:
    from eagle_jax.benchmarks import harness as H
    from eagle_jax.config import SpecConfig
    from eagle_jax.generate import Generator

    ms_list = (1, 2, 5, 8, 12, 16, 32) if quick else FORWARD_M
    max_new = 48 if quick else 96
    chain_k = SpecConfig.num_speculative_tokens
    result = H.result_header("step_cost")
    result["mode"] = "quick" if quick else "full"
    result["settings"] = {"context": context, "long_context": long_context, "repeats": repeats,
                          "max_new_tokens": max_new, "prompt": PROMPT, "chain_k": chain_k,
                          "tree": [SpecConfig.tree_top_k, SpecConfig.tree_depth, SpecConfig.tree_total_tokens]}
    bw = bandwidth_gbps()
    result["bandwidth_gbps"] = bw
    log(f"bandwidth {bw:.1f} GB/s")
    result["dtypes"] = {}
    for dtype in dtypes:
        plain = Generator.load(target, draft=None, dtype=dtype)
        from eagle_jax.kernels import ops

        r = {"impl": ops.resolve(plain.impl), "weight_bytes": weight_bytes(plain.target_params)}
        floor_ms = r["weight_bytes"] / (bw * 1e9) * 1e3
        r["floor_ms"] = floor_ms
        r["forward"] = {}
        for b in ((1,) if quick else (1, 4)):
            costs = forward_costs(plain, ms_list, b, context, repeats)
            r["forward"][str(b)] = {str(m): {"ms": v, "vs_m1": v / costs[1], "vs_floor": v / floor_ms}
                                    for m, v in costs.items()}
            log(f"{dtype} forward b={b}: " + ", ".join(f"M={m} {v:.1f} ms ({v / costs[1]:.2f}x)"
                                                     for m, v in costs.items()))
        r["compute"] = compute_bound(r["forward"]["1"], floor_ms)
        log(f"{dtype} compute: {r['compute']['ms_per_row']:.2f} ms per row; at the bandwidth floor, M rows "
            "cost at least " + ", ".join(f"M={m} {v:.2f}x" for m, v in r["compute"]["vs_m1_at_floor"].items()))
        long = forward_costs(plain, (1,), 1, long_context, repeats)[1]
        short = r["forward"]["1"]["1"]["ms"]
        r["long_context"] = {"context": long_context, "ms": long, "vs_short": long / short}
        log(f"{dtype} plain forward at {long_context} context: {long:.1f} ms ({long / short:.2f}x of {context})")
        engines = {"plain": plain,
                   f"chain{chain_k}": Generator.load(target, draft="default", dtype=dtype,
                                                     spec=SpecConfig("chain", num_speculative_tokens=chain_k,
                                                                     disable_by_batch_size=None)),
                   "tree": Generator.load(target, draft="default", dtype=dtype,
                                          spec=SpecConfig("tree", disable_by_batch_size=None))}
        r["drafter"] = drafter_costs(engines["tree"], context, repeats)
        r["drafter"]["vs_target_m1"] = {k: v / short for k, v in r["drafter"].items() if k != "weight_bytes"}
        steps = steady_steps(engines, max_new, rounds=3 if quick else 5)
        base = steps["plain"]
        plain_tokens = base["tokens"]
        for name, s in steps.items():
            s["vs_plain_step"] = s["ms_per_step"] / base["ms_per_step"]
            s["speedup"] = s["tokens_per_s"] / base["tokens_per_s"]
            s["greedy_match"] = s.pop("tokens") == plain_tokens
            log(f"{dtype} {name}: {s['ms_per_step']:.1f} ms/step ({s['vs_plain_step']:.2f}x plain), "
                f"tau {s['tau']}, {s['tokens_per_s']:.1f} tok/s ({s['speedup']:.2f}x)")
        r["steps"] = steps
        r["breakdown"] = {name: _trace_scopes(g, max_new) for name, g in engines.items()}
        log(f"{dtype} breakdown (ms/step): {json.dumps(r['breakdown'])}")
        if not quick:
            one = batched_throughput(plain, 1, 32, 1)
            many = batched_throughput(plain, 16, 32, 1)
            r["batched"] = {"rows_1_tok_s": one, "rows_16_tok_s": many, "ratio": many / one}
            log(f"{dtype} batched decode: 16 rows {many:.0f} tok/s vs 1 row {one:.0f} ({many / one:.1f}x)")
        result["dtypes"][dtype] = r
    return result


def main(argv=None) -> int:
    from eagle_jax.benchmarks import harness as H

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dtype", default="bfloat16,float32", help="comma list")
    p.add_argument("--output-dir", default=None)
    args = p.parse_args(argv)
    result = run(tuple(args.dtype.split(",")), quick=args.quick)
    print(H.write_result(result, args.output_dir, prefix=f"{result['suite']}-{result['mode']}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
