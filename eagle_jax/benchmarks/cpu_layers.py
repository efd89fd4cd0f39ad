"""Two CPU facts the decoding speed rests on, measured on SmolLM2 fp32 (one run, interleaved).

    python benchmarks/cpu_layers.py [--repeats 15]

1. One decode step (batch 1, one token, 256-slot cache, the `Target` call +
   logits, cache donated) with the layers stacked under `lax.scan` against
   the per-layer buffers of `target.unstack_layers` (an unrolled loop).
2. The weight matmuls of all 30 layers alone (x @ wqkv, x @ wo,
   x @ w_gate_up, x @ w_down) for M = 1, 4, 12, 16 rows: what verifying M
   tokens at once costs against a single-token matvec.

Prints one JSON object (medians in ms, plus the ratios).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from eagle_jax.benchmarks.plain_vs_transformers import layer_matmuls, median_ms


def main(repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from eagle_jax.convert.registry import load_target
    from eagle_jax.models import target

    t = load_target("smollm2-135m-instruct", dtype="float32")
    cfg, stacked = t.cfg, t.params
    unrolled = target.unstack_layers(stacked)
    tok, pos = jnp.array([[42]], jnp.int32), jnp.array([[100]], jnp.int32)

    def step(params, cache):
        model = target.Target(cfg, params)
        h, cache, _ = model(tok, pos, cache)
        return model.logits(h[:, -1]), cache

    step_jit = jax.jit(step, donate_argnums=1)

    def step_ms(params):
        cache = target.create_cache(cfg, 1, 256).replace(lengths=jnp.array([100], jnp.int32))
        ts = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            out, cache = step_jit(params, cache)
            jax.block_until_ready(out)
            if i:  # the first call compiles
                ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts)

    scan, unroll = [], []
    for _ in range(2):  # interleaved
        scan.append(step_ms(stacked))
        unroll.append(step_ms(unrolled))

    matmuls = jax.jit(lambda params, x: layer_matmuls(params, cfg, x))

    by_m = {}
    for m in (1, 4, 12, 16):
        x = jnp.full((m, cfg.hidden_size), 0.01, jnp.float32)
        by_m[m] = median_ms(matmuls, unrolled, x, repeats=repeats)
    return {"decode_step_ms": {"scan_stacked": min(scan), "unrolled_per_layer": min(unroll)},
            "scan_over_unrolled": min(scan) / min(unroll),
            "layer_matmuls_ms_by_rows": by_m,
            "cost_vs_one_row": {m: v / by_m[1] for m, v in by_m.items()}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    print(json.dumps(main(ap.parse_args().repeats), indent=1))
