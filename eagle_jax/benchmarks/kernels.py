"""Benchmark fused RMSNorm + matmul against `jnp.dot(rms_norm(x), w)`.

Usage: python benchmarks/kernels.py [--json out.json] [--models smollm2,llama]
       [--m 1,4,8,16,64] [--dtype bfloat16] [--repeats 30] [--inner 10]

For each decode shape it times, under jit on the current backend, after
warm-up:

* ``fused``: `fused_norm_matmul(x, g, w, impl="pallas")` on the raw gains
  and weight, as a decoder runs it (the kernel scales x by the gains);
* ``xla``: `rms_norm_matmul_reference`, i.e. ``jnp.dot(rms_norm(x) * g, w)``.

One sample = ``inner`` back-to-back calls then `block_until_ready` on the
last, divided by ``inner``; the reported time is the median of ``repeats``
samples. Bytes moved are the logical bytes of W + x + out (K*N + M*K + M*N
elements); bandwidth fraction is relative to a device-to-device copy
(``a + 1`` in place over a large f32 buffer, read + write) measured in the same run.

On CPU there is no compiled Pallas: only the XLA path is timed (and the
table says so); by default only the SmolLM2 shapes are run there, since the
Llama matrices are gigabytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

try:
    from eagle_jax.kernels import fused_norm_matmul, rms_norm_matmul_reference
except ImportError as e:  # pragma: no cover
    sys.exit(f"cannot import eagle_jax.kernels ({e}); run `pip install -e .` in the repository first")

EPS = 1e-5

# (model, op, K, N, segments)
SHAPES = {
    "smollm2": [
        ("SmolLM2-135M", "qkv", 576, 576 + 2 * 192, 1),
        ("SmolLM2-135M", "gate_up", 576, 2 * 1536, 1),
        ("SmolLM2-135M", "lm_head", 576, 49152, 1),
        ("SmolLM2-135M", "eagle_fc", 3 * 576, 576, 3),
    ],
    "llama": [
        ("Llama-3.1-8B", "qkv", 4096, 6144, 1),
        ("Llama-3.1-8B", "gate_up", 4096, 28672, 1),
        ("Llama-3.1-8B", "lm_head", 4096, 128256, 1),
        ("Llama-3.1-8B", "eagle_fc", 3 * 4096, 4096, 3),
    ],
}


def _time(fn, args, repeats, inner, warmup=3):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def measure_copy_bandwidth(nbytes, repeats):
    """Bytes/s of ``a + 1`` over an f32 buffer (read + write), donated in place."""
    n = nbytes // 4
    f = jax.jit(lambda v: v + 1.0, donate_argnums=0)
    a = jax.block_until_ready(f(jnp.zeros((n,), jnp.float32)))
    for _ in range(2):
        a = jax.block_until_ready(f(a))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a = jax.block_until_ready(f(a))
        samples.append(time.perf_counter() - t0)
    del a
    return 2 * n * 4 / statistics.median(samples)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--models", default=None,
                   help="comma list of smollm2,llama (default: both; smollm2 only on CPU)")
    p.add_argument("--m", default="1,4,8,16,64", help="comma list of row counts M")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on GPU/TPU) or float32 (default on CPU; "
                   "not on a GPU, whose kernel takes 16-bit dtypes)")
    p.add_argument("--repeats", type=int, default=None, help="samples per timing (median)")
    p.add_argument("--inner", type=int, default=None, help="back-to-back calls per sample")
    args = p.parse_args(argv)

    if os.environ.pop("EAGLE_JAX_KERNEL_IMPL", None):
        print("note: ignoring $EAGLE_JAX_KERNEL_IMPL in the benchmark (impls are chosen explicitly)")
    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    dev = jax.devices()[0]
    models = (args.models or ("smollm2" if on_cpu else "smollm2,llama")).split(",")
    for m in models:
        if m not in SHAPES:
            p.error(f"unknown model {m!r}; choose from {sorted(SHAPES)}")
    ms = [int(v) for v in args.m.split(",")]
    dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
    if backend in ("gpu", "cuda", "rocm") and dtype == jnp.float32:
        p.error("on a GPU the Pallas kernel takes bfloat16 or float16 (wgmma has no IEEE float32 path); "
                "use --dtype bfloat16")
    repeats = args.repeats or (5 if on_cpu else 30)
    inner = args.inner or (1 if on_cpu else 10)

    copy_bytes = (256 if on_cpu else 2048) * 2**20
    copy_bw = measure_copy_bandwidth(copy_bytes, repeats=max(5, repeats // 3))

    print(f"backend={backend} device={dev.device_kind} jax={jax.__version__} dtype={dtype.name} "
          f"repeats={repeats} inner={inner}")
    print(f"measured copy bandwidth (a+1 in place over {copy_bytes // 2**20} MiB f32, read+write): "
          f"{copy_bw / 1e9:.1f} GB/s")
    if on_cpu:
        print("CPU backend: Pallas cannot be compiled here, timing the XLA path only "
              "(fused_norm_matmul impl='auto' dispatches to it on CPU).")

    rows = []
    rng = np.random.default_rng(0)
    for model in models:
        for (mname, op, k, n, s) in SHAPES[model]:
            w = jnp.asarray(rng.standard_normal((k, n), np.float32) / np.sqrt(k), dtype)
            g_shape = (k,) if s == 1 else (s, k // s)
            g = jnp.asarray(rng.uniform(0.5, 1.5, g_shape).astype(np.float32), dtype)
            xla = jax.jit(lambda x, g, w, s=s: rms_norm_matmul_reference(x, g, w, eps=EPS, segments=s))
            if not on_cpu:
                fused = jax.jit(lambda x, g, w, s=s: fused_norm_matmul(
                    x, g, w, eps=EPS, segments=s, impl="pallas"))
            for m in ms:
                x = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
                nbytes = (k * n + m * k + m * n) * dtype.itemsize
                row = dict(model=mname, op=op, M=m, K=k, N=n, segments=s, dtype=dtype.name, bytes=nbytes)
                t_x = _time(xla, (x, g, w), repeats, inner)
                row.update(xla_us=t_x * 1e6, xla_gbps=nbytes / t_x / 1e9, xla_frac=nbytes / t_x / copy_bw)
                if not on_cpu:
                    t_f = _time(fused, (x, g, w), repeats, inner)
                    y_f = np.asarray(fused(x, g, w), np.float32)
                    y_x = np.asarray(xla(x, g, w), np.float32)
                    rel = float(np.linalg.norm(y_f - y_x) / max(np.linalg.norm(y_x), 1e-30))
                    row.update(fused_us=t_f * 1e6, fused_gbps=nbytes / t_f / 1e9,
                               fused_frac=nbytes / t_f / copy_bw, speedup=t_x / t_f, relerr_vs_xla=rel)
                rows.append(row)
                _print_row(row, on_cpu, header=len(rows) == 1)
            del w, g

    if args.json:
        meta = dict(backend=backend, device_kind=dev.device_kind, jax_version=jax.__version__,
                    dtype=dtype.name, repeats=repeats, inner=inner, copy_bandwidth_Bps=copy_bw,
                    timed=("xla only (CPU)" if on_cpu else "fused pallas and xla"), eps=EPS)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1)
        print(f"wrote {args.json}")
    return rows


def _print_row(r, on_cpu, header):
    if header:
        if on_cpu:
            print("\n| model | op | M | K | N | S | xla us | xla GB/s | xla %copy |")
            print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        else:
            print("\n| model | op | M | K | N | S | fused us | fused GB/s | fused %copy "
                  "| xla us | xla GB/s | xla %copy | speedup | relerr |")
            print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = f"| {r['model']} | {r['op']} | {r['M']} | {r['K']} | {r['N']} | {r['segments']} |"
    xla = f" {r['xla_us']:.1f} | {r['xla_gbps']:.1f} | {100 * r['xla_frac']:.1f}% |"
    if on_cpu:
        print(base + xla, flush=True)
    else:
        fused = f" {r['fused_us']:.1f} | {r['fused_gbps']:.1f} | {100 * r['fused_frac']:.1f}% |"
        print(base + fused + xla + f" {r['speedup']:.2f}x | {r['relerr_vs_xla']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
