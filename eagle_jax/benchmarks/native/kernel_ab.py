"""A/B two versions of kernels/cpu/eagle_cpu.cc in one process, on SmolLM2's real forward.

    python -m eagle_jax.benchmarks.native.kernel_ab OLD.cc NEW.cc [--dtype bfloat16]
        [--m 1,4,9,16] [--context 256] [--rounds 12] [--inner 8]

(e.g. `git show HEAD~1:kernels/cpu/eagle_cpu.cc > /tmp/old.cc` against the working copy.)
Both versions are called through the working copy's wrappers, so both must take
their operands: a source from before `eagle_cache_write` took a first layer
(6f3385c) fails any forward that writes through it (prefill-length M, or a
head size the native attention does not take).
Both sources are compiled with the package's own flags and registered with
XLA under suffixed target names; each (version, M) gets its own jitted loop of
`--inner` target forwards over M new tokens per row at `--context` committed
cache slots (cache donated, logits of the last row summed so nothing is dead),
and the two versions' calls alternate within each round (AB, then BA). The
machine's load drifts by tens of percent over minutes, so only ratios
measured this way are worth reading: it prints ms per forward (p25 and median
over rounds) for each version and M, and NEW/OLD at p25, as one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.kernels import cpu

# The library's FFI targets: the name jax.ffi.ffi_call uses -> the exported handler symbol.
_TARGETS = {"eagle_matmul": "EagleMatmul", "eagle_matmul_into": "EagleMatmulInto",
            "eagle_attention": "EagleAttention", "eagle_cache_write": "EagleCacheWrite",
            "eagle_cache_compact": "EagleCacheCompact", "eagle_embed": "EagleEmbed", "eagle_argmax": "EagleArgmax"}


def _register(tag: str, source: Path, out_dir: Path) -> None:
    """Compile `source` and register its handlers as '<name>_<tag>'."""
    so = out_dir / f"lib_{tag}.so"
    cmd = [cpu._compiler(), *cpu._FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(so)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"kernel_ab: {source} does not compile: {done.stderr.strip().splitlines()[-1]}")
    lib = ctypes.cdll.LoadLibrary(str(so))
    for name, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(f"{name}_{tag}", jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


_current = {"tag": None}
_ffi_call = jax.ffi.ffi_call


def _routed_ffi_call(name, *args, **kwargs):
    """jax.ffi.ffi_call, sending the library's targets to the version being traced."""
    tag = _current["tag"]
    return _ffi_call(f"{name}_{tag}" if tag and name in _TARGETS else name, *args, **kwargs)


@contextlib.contextmanager
def _version(tag: str):
    _current["tag"] = tag
    try:
        yield
    finally:
        _current["tag"] = None


def main(old: Path, new: Path, dtype: str, ms: tuple[int, ...], context: int, rounds: int, inner: int) -> dict:
    from eagle_jax.benchmarks.step_cost import forward_loop
    from eagle_jax.generate import Generator
    from eagle_jax.models import target

    cpu.require()
    with tempfile.TemporaryDirectory() as d:
        for tag, src in (("A", old), ("B", new)):
            _register(tag, src, Path(d))
    jax.ffi.ffi_call = _routed_ffi_call
    gen = Generator.load("smollm2-135m-instruct", draft=None, dtype=dtype)
    cfg, params = gen.target_cfg, gen.target_params
    runs = {}
    for tag in "AB":
        for m in ms:
            f = forward_loop(gen, inner)
            cache = target.create_cache(cfg, 1, context + m + 64, params["embed"].dtype)
            cache = cache.replace(lengths=jnp.full((1,), context, jnp.int32))
            tok = jnp.full((1, m), 42, jnp.int32)
            pos = context + jnp.arange(m, dtype=jnp.int32)[None]
            with _version(tag):  # traced, compiled and run once under this version's targets
                cache, acc = f(params, cache, tok, pos)
                acc.block_until_ready()
            runs[tag, m] = [f, cache, tok, pos, []]
    for r in range(rounds):
        for m in ms:
            for tag in ("AB" if r % 2 == 0 else "BA"):
                run = runs[tag, m]
                t0 = time.perf_counter()
                run[1], acc = run[0](params, run[1], run[2], run[3])
                acc.block_until_ready()
                run[4].append(1e3 * (time.perf_counter() - t0) / inner)
    p25 = {k: float(np.percentile(v[4], 25)) for k, v in runs.items()}
    return {"old": str(old), "new": str(new), "dtype": dtype, "context": context, "rounds": rounds,
            "inner": inner,
            "ms_per_forward": {f"{tag} M={m}": {"p25": round(p25[tag, m], 3),
                                                "median": round(float(np.median(runs[tag, m][4])), 3)}
                               for tag in "AB" for m in ms},
            "new_over_old_p25": {f"M={m}": round(p25["B", m] / p25["A", m], 3) for m in ms}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--m", default="1,4,9,16", help="new tokens per row, comma-separated")
    ap.add_argument("--context", type=int, default=256, help="committed cache slots")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--inner", type=int, default=8, help="forwards per timed call")
    a = ap.parse_args()
    print(json.dumps(main(a.old, a.new, a.dtype, tuple(int(x) for x in a.m.split(",")), a.context, a.rounds,
                          a.inner)))
