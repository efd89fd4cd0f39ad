"""Native CPU kernels (C++ through `jax.ffi`): packed-weight matmul and cache attention.

XLA:CPU computes one row with its own GEMV but hands 2..32 rows to a library
GEMM that repacks the weight on every call, so verifying k+1 draft tokens
costs 1.6-3x a plain step, and attention reads the whole allocated cache.
`eagle_cpu.cc` streams each weight once for all rows of a call from a layout
packed once at load time, and attends over the live cache slots only; both
reduce in an order independent of the number of rows, so a verify step
reproduces single-token steps bit for bit (greedy speculative == plain).

* `pack_weights(ws)`: weights W [K, N] (float32 or bfloat16) -> `PackedWeight`s
  in one host block on huge pages, done once per model
  (`eagle_jax.models.target.prepare_for_decoding`); `pack_weight(w)`: one.
* `matmul(x, pw)`: x [..., K] -> float32 [..., N]; x is cast to the
  weight's dtype (bf16 x bf16 products are exact in f32; accumulation f32);
  optionally with an RMSNorm of x first and a residual add or SwiGLU after.
  bf16 runs on AMX tiles where the CPU has them (`amx()`; Intel Sapphire
  Rapids and later): on a Xeon (Emerald Rapids), one core, SmolLM2 bf16, a
  forward over 16 tokens went from 2.41x to 1.48x the one-token forward and
  a chain k=3 step from 1.77x to 1.30x a plain step (`EAGLE_JAX_CPU_AMX=0`
  / `1 eagle-jax bench --suite step-cost --quick --dtype bfloat16`,
  `step_cost-quick-20261206-113420` / `-105926`).
* `attention(...)`: the fused q/k/v projection of T new tokens, rotated in
  the kernel (RoPE, Qwen3's q/k norms), over the committed slots of one layer
  of a [L, B, Hkv, S, D] cache (or those a per-query slot mask shows) plus the
  T new keys under a [B, T, T] mask; it also stores the new K/V in that layer
  (the cache is threaded through the layers and the drafter steps).
* `cache_write`, `cache_compact`: the KV cache's slot updates, in place
  (XLA:CPU runs a bf16 scatter by converting the whole cache to f32 and back).
* `embed(table, ids)`: embedding rows (XLA:CPU gathers a bf16 row from an f32
  copy of the whole table).
* `transpose(x)`: a 2-D transpose XLA cannot fold into the dot that reads it
  (training's bf16 backward dots).
* `argmax(x)`: the first maximal index of each float32 row: a vectorised max,
  then a scan that stops at that index (the XLA path reduces the whole row twice).
* `kth_largest_key(x, k)`, `top_p_cut_key(probs, p)`: the thresholds of the
  top-k and top-p sampling filters as order keys: the XLA path's bisection,
  each step a vectorised pass over the row's keys (both filters over 4 x 3
  rows of 49,152 logits: 24.5 -> 4.0 ms on one Xeon core,
  `python -m eagle_jax.benchmarks.filters`).

None of these has a gradient rule: they serve decoding; training runs XLA.

The library is compiled from `eagle_cpu.cc` with the system C++ compiler on
first use (or by `make setup`: `python -m eagle_jax.kernels.cpu`) into
`$EAGLE_JAX_CACHE/native/` (default ~/.cache/eagle_jax), keyed by the
source, compiler, flags, jaxlib and CPU, and loaded with ctypes. Without a
compiler `available()` is False and `impl="auto"` uses XLA.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.metadata
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = Path(__file__).with_name("eagle_cpu.cc")
COLS = 64  # columns per packed tile (eagle_cpu.cc kCols)
# Longer forwards attend through XLA. Native up to the default prefill chunk:
# measured on a 179-token prompt (padded to 256), bf16, one core: attention
# 220 -> 71 ms of a 0.53 -> 0.43 s prefill.
MAX_ATTENTION_TOKENS = 512
AMX_ENV = "EAGLE_JAX_CPU_AMX"
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")


class NativeKernelError(RuntimeError):
    """The native CPU kernels cannot be built or loaded here."""


_lock = threading.Lock()
_state: dict[str, Any] = {}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def wide_vectors() -> bool:
    """Whether this CPU has AVX-512 (the vector width the verify-width matmul tiles were
    tuned for; AVX2-only CPUs get narrower tiles and about a fifth of the compute per row)."""
    return "avx512f" in _cpu_id().split()


def library_path() -> Path:
    """Where the compiled library for this source, compiler and CPU lives."""
    cxx = _compiler() or "none"
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cxx, " ".join(_FLAGS), jax.__version__,
                                    importlib.metadata.version("jaxlib"), _cpu_id()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("EAGLE_JAX_CACHE") or Path.home() / ".cache" / "eagle_jax")
    return root / "native" / key / "libeagle_cpu.so"


def build() -> Path:
    """Compile the library if it is not built yet; returns its path."""
    out = library_path()
    if out.is_file():
        return out
    cxx = _compiler()
    if cxx is None:
        raise NativeKernelError("no C++ compiler found (set CXX or install g++); the XLA path is used")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        first = next((l for l in proc.stderr.splitlines() if "error" in l), proc.stderr.strip()[:300])
        raise NativeKernelError(f"compiling {SOURCE.name} failed: {first}")
    os.replace(tmp, out)  # atomic: a concurrent build or a killed one never leaves half a library
    return out


def _load() -> None:
    with _lock:
        if "error" in _state or "lib" in _state:
            return
        if jax.default_backend() != "cpu":
            _state["error"] = f"the native kernels run on CPU; the backend is {jax.default_backend()!r}"
            return
        try:
            lib = ctypes.cdll.LoadLibrary(str(build()))
        except (NativeKernelError, OSError) as e:
            _state["error"] = str(e)
            return
        for name, symbol in (("eagle_matmul", lib.EagleMatmul), ("eagle_matmul_into", lib.EagleMatmulInto),
                             ("eagle_attention", lib.EagleAttention),
                             ("eagle_cache_write", lib.EagleCacheWrite),
                             ("eagle_cache_compact", lib.EagleCacheCompact), ("eagle_embed", lib.EagleEmbed),
                             ("eagle_transpose", lib.EagleTranspose),
                             ("eagle_argmax", lib.EagleArgmax), ("eagle_kth_largest", lib.EagleKthLargest),
                             ("eagle_top_p_cut", lib.EagleTopPCut)):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
        _state["amx"] = bool(lib.EagleAmxAvailable()) and os.environ.get(AMX_ENV, "1") != "0"
        _state["lib"] = lib


def amx() -> bool:
    """Whether bf16 matmuls run on AMX tiles (Intel Sapphire Rapids and later,
    Linux 5.16+), for every call of this process: tiles and vectors round
    their sums differently, and the greedy equivalence rests on a verify
    step's rows equalling single-token steps bit for bit. $EAGLE_JAX_CPU_AMX=0
    keeps the AVX-512 vectors (read when the library loads)."""
    _load()
    return _state.get("amx", False)


def available() -> bool:
    """True when the library is built (or builds now) and loads on this backend."""
    _load()
    return "lib" in _state


def unavailable_reason() -> str | None:
    _load()
    return _state.get("error")


def require() -> None:
    if not available():
        raise NativeKernelError(f"native CPU kernels unavailable: {_state['error']}")


# ---------------------------------------------------------------------------
# Packed weights and matmul
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """W [k, n] in the kernel's tile layout (see `pack_weight`); k, n static."""

    data: Any
    k: int
    n: int

    @property
    def dtype(self):
        return self.data.dtype

    def unpack(self) -> jax.Array:
        """The [k, n] weight again (tests, reference paths)."""
        d = self.data
        if d.ndim == 4:  # bf16 pairs [T, K/2, 64, 2] -> [K/2, 2, T, 64]
            d = d.transpose(1, 3, 0, 2).reshape(-1, d.shape[0] * COLS)
        else:  # [T, K, 64] -> [K, T * 64]
            d = d.transpose(1, 0, 2).reshape(self.data.shape[1], -1)
        return d[: self.k, : self.n]


jax.tree_util.register_dataclass(PackedWeight, data_fields=["data"], meta_fields=["k", "n"])


def _packed_layout(w) -> tuple[tuple[int, ...], int, int]:
    """The packed shape of W [K, N] or stacked [L, K, N], and K, N."""
    dtype = jnp.dtype(w.dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"pack_weight takes float32 or bfloat16 weights, got {dtype}")
    if w.ndim not in (2, 3) or 0 in w.shape:
        raise ValueError(f"pack_weight takes a [K, N] (or stacked [L, K, N]) weight with K, N >= 1, "
                         f"got shape {tuple(w.shape)}")
    *lead, k, n = w.shape
    tiles = -(-n // COLS)
    if dtype == jnp.dtype(jnp.bfloat16):
        return (*lead, tiles, -(-k // 2), COLS, 2), k, n
    return (*lead, tiles, k, COLS), k, n


def _pack_into(out: np.ndarray, w: np.ndarray) -> None:
    """Write W [K, N] into `out`, its packed layout (zeros where padded)."""
    k, n = w.shape
    tiles = out.shape[0]
    kp = out.shape[1] * (2 if out.ndim == 4 else 1)
    padded = np.zeros((kp, tiles * COLS), w.dtype)
    padded[:k, :n] = w
    if out.ndim == 4:  # bf16 pairs
        out[...] = padded.reshape(kp // 2, 2, tiles, COLS).transpose(2, 0, 3, 1)
    else:
        out[...] = padded.reshape(kp, tiles, COLS).transpose(1, 0, 2)


_HUGE_PAGE = 2 << 20


def _host_block(nbytes: int) -> np.ndarray:
    """nbytes of zeroed uint8 host memory; from 2 MiB on, 2 MiB aligned on a
    private anonymous mapping marked for transparent huge pages where the OS
    has them.

    A decode step streams every weight once; with 4 KiB pages the TLB misses
    of that stream cost about a twentieth of a bf16 step (2-core EPYC, the same
    weights in XLA's buffers against this block, interleaved: 11.42 -> 10.83 ms
    per token, median; benchmarks/results/analysis.md, sixth kernel pass). The
    memory is returned when the last array viewing it is gone."""
    flags = getattr(mmap, "MAP_PRIVATE", None)
    if flags is None or nbytes < _HUGE_PAGE:  # no POSIX mmap, or too small to hold a huge page
        return np.zeros(nbytes, np.uint8)
    m = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=flags | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    block = np.frombuffer(m, np.uint8)
    start = -block.ctypes.data % _HUGE_PAGE
    return block[start:start + nbytes]


def pack_weights(ws) -> list[PackedWeight]:
    """Several weights, each [K, N] or stacked [L, K, N] (float32 or bfloat16),
    -> `PackedWeight`s laid out one after another in one host block (see
    `_host_block`), done once per model.

    float32: [ceil(N/64), K, 64]; bfloat16: [ceil(N/64), ceil(K/2), 64, 2] with
    rows 2i and 2i+1 interleaved (a stacked weight: [L, ...] of these). Padding
    is zeros. On CPU the arrays are the block itself (no copy)."""
    ws = [np.asarray(w) for w in ws]
    layouts = [_packed_layout(w) for w in ws]
    sizes = [-(-int(np.prod(shape)) * w.dtype.itemsize // 4096) * 4096 for w, (shape, _, _) in zip(ws, layouts)]
    block = _host_block(sum(sizes))
    out, offset = [], 0
    for w, (shape, k, n), size in zip(ws, layouts, sizes):
        view = block[offset:offset + size].view(w.dtype)[:int(np.prod(shape))].reshape(shape)
        offset += size
        per_matrix = shape[w.ndim - 2:]  # drop the stacking axis, if any
        for dst, src in zip(view.reshape(-1, *per_matrix), w.reshape(-1, k, n)):
            _pack_into(dst, src)
        view.flags.writeable = False
        out.append(PackedWeight(jax.device_put(view), k, n))
    return out


def pack_weight(w) -> PackedWeight:
    """W [K, N] (or stacked [L, K, N]) -> PackedWeight: `pack_weights` of one."""
    return pack_weights([w])[0]


EPILOGUES = {"plain": 0, "residual": 1, "swiglu": 2}  # eagle_cpu.cc Epilogue


def fuses_norm(pw: PackedWeight) -> bool:
    """Whether `matmul(..., norm_weight=)` takes this weight (bf16 pairs need an even K)."""
    return pw.data.ndim == 3 or pw.k % 2 == 0


def fuses_swiglu(pw: PackedWeight) -> bool:
    """Whether `matmul(..., swiglu=True)` takes this [gate | up] weight."""
    return pw.n % (2 * COLS) == 0


def matmul(x, pw: PackedWeight, out_dtype=jnp.float32, *, norm_weight=None, eps: float = 0.0,
           segments: int = 1, residual=None, swiglu: bool = False, preset: float | None = None) -> jax.Array:
    """x [..., K] @ W -> [..., N] in out_dtype (float32 or bfloat16, rounded
    once from the f32 accumulator), W packed by `pack_weight`; x is cast to
    the weight's dtype.

    norm_weight [K]: RMSNorm x first (each of `segments` equal parts of K
    on its own), as the XLA path does in the weight's dtype (f32 statistics;
    the normalised x and its product with the gain each rounded).
    residual [..., N]: return residual + y, y rounded first (`h + x @ W`).
    swiglu: W is [gate | up] with N/2 a multiple of 64; returns
    silu(gate) * up, [..., N/2], each factor rounded first.
    preset: the kernel writes into an output buffer filled with this value
    first, so an element it fails to write keeps it (the kernel tests pass NaN).
    """
    require()
    if x.shape[-1] != pw.k:
        raise ValueError(f"x has K={x.shape[-1]}, the packed weight K={pw.k}")
    if swiglu and (residual is not None or not fuses_swiglu(pw)):
        raise ValueError(f"swiglu takes no residual and needs N/2 a multiple of {COLS}, got N={pw.n}")
    n_out = pw.n // 2 if swiglu else pw.n
    lead = x.shape[:-1]
    x2 = x.reshape(-1, pw.k).astype(pw.dtype)
    gamma = jnp.zeros((0,), pw.dtype)
    if norm_weight is not None:
        if not fuses_norm(pw):
            raise ValueError(f"the fused RMSNorm needs an even K for bfloat16 weights, got K={pw.k}")
        if norm_weight.shape != (pw.k,) or pw.k % segments:
            raise ValueError(f"norm_weight must be [K={pw.k}] with K a multiple of segments={segments}, "
                             f"got shape {norm_weight.shape}")
        gamma = norm_weight.astype(pw.dtype)
    if pw.data.ndim == 4 and pw.k % 2:
        x2 = jnp.pad(x2, ((0, 0), (0, 1)))
    res = jnp.zeros((0,), out_dtype)
    if residual is not None:
        if residual.shape != (*lead, n_out):
            raise ValueError(f"residual must be {(*lead, n_out)}, got {residual.shape}")
        res = residual.reshape(-1, n_out).astype(out_dtype)
    if x2.shape[0] == 0:
        return jnp.zeros((*lead, n_out), out_dtype)
    out = jax.ShapeDtypeStruct((x2.shape[0], n_out), out_dtype)
    epilogue = "swiglu" if swiglu else "plain" if residual is None else "residual"
    attrs = {"eps": np.float32(eps), "epilogue": np.int32(EPILOGUES[epilogue]),
             "segments": np.int32(segments), "amx": np.int32(pw.dtype == jnp.bfloat16 and amx())}
    if preset is None:
        y = jax.ffi.ffi_call("eagle_matmul", out)(x2, pw.data, gamma, res, **attrs)
    else:
        preset = jnp.full(out.shape, preset, out_dtype)
        y = jax.ffi.ffi_call("eagle_matmul_into", out, input_output_aliases={4: 0})(
            x2, pw.data, gamma, res, preset, **attrs)
    return y.reshape(*lead, n_out)


# ---------------------------------------------------------------------------
# Attention over the committed cache slots
# ---------------------------------------------------------------------------


def attention(qkv, cos, sin, k_cache, v_cache, layer, lengths, new_mask, *, num_heads: int,
              qk_norm=None, eps: float = 0.0, slot_mask=None):
    """Attend T new tokens and store their K/V, for one layer of the cache.

    qkv [B,T,(Hq+2Hkv)*D]: the fused projection, q then k then v heads; cos/sin
    [B,T,D] (`rope_tables`); k_cache/v_cache [L,Bc,Hkv,S,D] (the whole cache,
    float32 or bfloat16; its first B of Bc >= B rows are the call's, the
    others are neither read nor written); layer: int or int32 scalar; lengths [B] committed
    slots; new_mask [B,T,T] bool; qk_norm: None or Qwen3's (q_norm, k_norm)
    weights, each [D], applied per head before RoPE; slot_mask: None or [B,T,S]
    bool, the cache slots each query may see. head_dim 64 or 128.

    qkv is taken in the cache's dtype; q and k are rotated in the kernel, as
    `models.layers.rotate_qk` does, and rounded to that dtype (so that a key
    scores the same as a new key and later from the cache). Every query sees
    slots [0, lengths[b]) of its row (with a slot mask: the slots its mask
    row allows) plus the new keys its new_mask row allows; the slots read are
    the committed ones and, with a slot mask, every one up to the last that
    some query of the row may see. The new K/V are then written to slots
    lengths[b] + t of `layer` (past the end: dropped). Returns (out [B,T,Hq,D] in the cache dtype, k_cache, v_cache),
    the caches updated in place: thread them from layer to layer.
    """
    require()
    b, t, width = qkv.shape
    hkv, d = k_cache.shape[2], k_cache.shape[4]
    if d not in (64, 128):
        raise ValueError(f"the native attention takes head_dim 64 or 128, got {d}")
    if width != (num_heads + 2 * hkv) * d:
        raise ValueError(f"qkv width {width} is not (num_heads {num_heads} + 2 x {hkv} KV heads) x head_dim {d}")
    dt = k_cache.dtype
    gains = (jnp.zeros((1,), dt),) * 2 if qk_norm is None else tuple(g.astype(dt) for g in qk_norm)
    if slot_mask is not None and slot_mask.shape != (b, t, k_cache.shape[3]):
        raise ValueError(f"slot_mask must be [B, T, S] = {(b, t, k_cache.shape[3])}, got {slot_mask.shape}")
    cache = jax.ShapeDtypeStruct(k_cache.shape, dt)
    return jax.ffi.ffi_call(
        "eagle_attention", (jax.ShapeDtypeStruct((b, t, num_heads, d), dt), cache, cache),
        input_output_aliases={5: 1, 6: 2})(
        qkv.astype(dt), cos.astype(jnp.float32), sin.astype(jnp.float32), *gains, k_cache, v_cache,
        jnp.asarray(layer, jnp.int32).reshape(1), lengths.astype(jnp.int32), new_mask.astype(bool),
        jnp.zeros((1,), bool) if slot_mask is None else slot_mask.astype(bool),
        scale=np.float32(1.0 / np.sqrt(d)), num_heads=np.int32(num_heads),
        qk_norm=np.int32(qk_norm is not None), eps=np.float32(eps), slot_masked=np.int32(slot_mask is not None))


# ---------------------------------------------------------------------------
# Cache writes in place
# ---------------------------------------------------------------------------


def cache_write(k_cache, v_cache, lengths, k_new, v_new, layer=0):
    """Store k_new/v_new [L', B, T, Hkv, D] at slots lengths[b] + t of layers
    layer .. layer + L' - 1 (int or int32 scalar) of the [L, Bc, Hkv, S, D]
    caches (rows b < B <= Bc; past the end: dropped). Returns (k, v), updated
    in place when the caches are donated."""
    require()
    shape = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    return jax.ffi.ffi_call("eagle_cache_write", (shape, shape), input_output_aliases={0: 0, 1: 1})(
        k_cache, v_cache, lengths.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
        k_new.astype(k_cache.dtype), v_new.astype(v_cache.dtype))


def cache_compact(k_cache, v_cache, lengths, src, n):
    """For each row b < B (src [B, A], lengths and n [B]; the caches may hold
    more rows) and j < n[b], copy slot lengths[b] + src[b, j] to lengths[b] + j
    (all sources read first). Returns (k, v)."""
    require()
    shape = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    return jax.ffi.ffi_call("eagle_cache_compact", (shape, shape), input_output_aliases={0: 0, 1: 1})(
        k_cache, v_cache, lengths.astype(jnp.int32), src.astype(jnp.int32), n.astype(jnp.int32))


# ---------------------------------------------------------------------------
# Embedding rows
# ---------------------------------------------------------------------------


def embed(table, ids):
    """table [V, H], ids [...] int -> table[clip(ids, 0, V - 1)] [..., H]."""
    require()
    out = jax.ShapeDtypeStruct((*ids.shape, table.shape[1]), table.dtype)
    return jax.ffi.ffi_call("eagle_embed", out)(table, ids.astype(jnp.int32))


def transpose(x):
    """x [R, C] (2- or 4-byte elements) -> x.T [C, R], in memory: a transpose
    XLA cannot fold into the dot that reads it (XLA:CPU runs a bf16 dot with a
    transposed operand as an f32 dot; training's backward dots,
    `eagle_jax.kernels.fused_norm_matmul._dot`)."""
    require()
    if x.ndim != 2 or x.dtype.itemsize not in (2, 4):
        raise ValueError(f"transpose takes a [R, C] array of 2- or 4-byte elements, got {x.shape} {x.dtype}")
    return jax.ffi.ffi_call("eagle_transpose", jax.ShapeDtypeStruct(x.shape[::-1], x.dtype))(x)


def argmax(x):
    """x [..., V] float32 -> [...] int32: the first maximal index (V - 1 for a row holding a NaN)."""
    require()
    return jax.ffi.ffi_call("eagle_argmax", jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32))(x.astype(jnp.float32))


# ---------------------------------------------------------------------------
# Sampling filter thresholds (eagle_jax.spec_decode.sampling)
# ---------------------------------------------------------------------------


def kth_largest_key(x, k):
    """x [..., V] float32, k [...] int32 -> [...] uint32: the order key
    (`sampling._ordered`) of each row's k-th largest value; 0, below every
    key, where k <= 0 or k >= V (the filter is off)."""
    require()
    out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.uint32)
    return jax.ffi.ffi_call("eagle_kth_largest", out)(x.astype(jnp.float32), k.astype(jnp.int32))


def top_p_cut_key(probs, p):
    """probs [..., V] float32, p [...] float32 -> [...] uint32: the order key of
    the smallest probability whose strictly larger ones hold less than p of the
    row's mass (ties kept together); 0 where p >= 1 or the row holds less than p."""
    require()
    out = jax.ShapeDtypeStruct(probs.shape[:-1], jnp.uint32)
    return jax.ffi.ffi_call("eagle_top_p_cut", out)(probs.astype(jnp.float32), p.astype(jnp.float32))
