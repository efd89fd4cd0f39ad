"""Time the top-k / top-p sampling filters (`process_logits`) on the XLA path and the native kernels.

Usage: python -m eagle_jax.benchmarks.filters [--json out.json] [--repeats 5] [--inner 30]

Random logits (normal, scale 3) at the target's and the draft vocabulary's
sizes, temperature 0.8, each shape and filter setting under jit on both
impls, after a warm-up call; the reported time is the least of `repeats`
samples of `inner` back-to-back calls, per call. Both impls in one process,
so their ratio is what to read.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from eagle_jax.spec_decode.sampling import SamplingParams, process_logits

SHAPES = [(4, 3, 49152), (16, 1, 49152), (4, 1, 8192)]  # a 4-row step verifying 3, 16 rows, draft vocab
SETTINGS = {"top_k 8": (8, 1.0), "top_p 0.9": (0, 0.9), "both": (8, 0.9)}


def _time(fn, args, repeats: int, inner: int) -> float:
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best * 1e3


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--inner", type=int, default=30)
    args = p.parse_args(argv)
    rows = []
    for shape in SHAPES:
        x = jax.random.normal(jax.random.PRNGKey(0), shape) * 3
        b = shape[0]
        for name, (k, top_p) in SETTINGS.items():
            params = SamplingParams(temperature=jnp.full((b,), 0.8), top_k=jnp.full((b,), k, jnp.int32),
                                    top_p=jnp.full((b,), top_p), coupled=jnp.zeros((b,), bool))
            ms = {impl: _time(jax.jit(lambda x, s, impl=impl: process_logits(x, s, impl=impl)), (x, params),
                              args.repeats, args.inner) for impl in ("xla", "native")}
            rows.append({"shape": list(shape), "filters": name, "xla_ms": ms["xla"], "native_ms": ms["native"]})
            print(f"{shape} {name}: xla {ms['xla']:.2f} ms, native {ms['native']:.2f} ms "
                  f"({ms['xla'] / ms['native']:.1f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m eagle_jax.benchmarks.filters", "machine": jax.devices()[0].device_kind,
                       "results": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
