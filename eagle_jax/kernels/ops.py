"""The op facade: every kernel the models, the KV cache and sampling call, in one place, each
dispatched on a backend name that is resolved once.

    impl = ops.resolve("auto")                 # "native", "xla", "pallas" or "interpret"
    LoopConfig(..., impl=impl)                 # carried in the loop's static config
    ops.embed(table, ids, impl=impl)           # what every op below takes

`resolve` reads ``$EAGLE_JAX_KERNEL_IMPL`` over the argument and resolves "auto" for this
backend (`fused_norm_matmul.auto_impl`: Pallas on TPU, XLA on GPU, the native CPU kernels on
CPU where they load). `Generator`, the trainer and the engine resolve their choice when they
are made; an op handed "auto" (a model called directly) resolves it here. Nothing outside
`eagle_jax.kernels` imports the native kernels (`kernels/cpu`) or resolves an impl.

Ops: `embed`, `argmax`, the sampling filters' thresholds (`kth_largest_key`, `top_p_cut_key`),
attention over the cache (`attends_natively`, `attention`), the cache write and compaction
(`cache_write`, `cache_compact`, `cache_rows_in_place`), the weight packing of the native
kernels (`pack_weights`) and the fused RMSNorm + projections (`fused_norm_matmul`, `matmul`,
`norm_swiglu`). Each native op has its XLA path here beside it.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from eagle_jax.kernels import cpu
from eagle_jax.kernels.fused_norm_matmul import ENV_VAR, fused_norm_matmul, matmul, norm_swiglu, resolve_impl

__all__ = ["resolve", "is_native", "cpu_features", "embed", "argmax", "ordered", "kth_largest_key", "top_p_cut_key",
           "attends_natively", "attention", "cache_write", "cache_compact", "cache_rows_in_place", "pack_weights",
           "fused_norm_matmul", "matmul", "norm_swiglu"]


def resolve(impl: str = "auto") -> str:
    """The backend that runs: ``$EAGLE_JAX_KERNEL_IMPL`` over `impl`, "auto" resolved; a
    ValueError names an unknown one, a NativeKernelError says why "native" cannot load."""
    return _resolve(impl, os.environ.get(ENV_VAR), jax.default_backend())


@functools.cache
def _resolve(impl: str, _forced: str | None, _backend: str) -> str:
    return resolve_impl(impl)


def resolve_on_devices(impl: str, devices: int) -> str:
    """`resolve(impl)` for a run over `devices` devices (a mesh): the native CPU kernels take
    whole packed weights, so there "auto" resolves past them (to XLA) and "native" is a
    ValueError; XLA's partitioner places the work, the Pallas kernels run on each device's block."""
    resolved = resolve(impl)
    if devices <= 1:
        return resolved
    if resolve("xla" if impl == "auto" else impl) == "native":
        raise ValueError(f"impl 'native' runs on one device; a mesh of {devices} runs through XLA or Pallas "
                         f"(impl 'auto', 'xla', 'pallas' or 'interpret')")
    return "xla" if resolved == "native" else resolved


def is_native(impl: str) -> bool:
    """Whether `impl` runs the native CPU kernels."""
    return resolve(impl) == "native"


def cpu_features() -> dict:
    """{"native": the kernels load, "amx": AMX tiles in use, "wide_vectors": AVX-512}."""
    native = cpu.available()
    return {"native": native, "amx": native and cpu.amx(), "wide_vectors": native and cpu.wide_vectors()}


# ----------------------------------------------------------------------------- embedding, argmax


def embed(table: jax.Array, ids: jax.Array, *, impl: str) -> jax.Array:
    """table [V, H], ids [...] int -> rows [..., H] (ids clipped to the table).

    The native kernel copies the rows (no gradient: decoding only); XLA:CPU
    would gather a bf16 row from an f32 copy of the whole table, made on
    every call."""
    if is_native(impl):
        return cpu.embed(table, ids)
    return jnp.take(table, ids, axis=0, mode="clip")


def argmax(logits: jax.Array, *, impl: str) -> jax.Array:
    """argmax over the last axis (the first maximal index), int32.

    Native: a vectorised max per row, then a scan that stops at the first
    index reaching it. XLA: two vectorised reductions (max, then the smallest
    index reaching it) over the whole row, since XLA:CPU runs jnp.argmax's joint
    (value, index) reduction one element at a time (about 1.4 ms over
    12 x 49k logits)."""
    if is_native(impl):
        return cpu.argmax(logits)
    v = logits.shape[-1]
    peak = jnp.max(logits, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(logits == peak, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
    return jnp.minimum(first, v - 1)  # a NaN row (no index reaches NaN) still gives a valid id


# ----------------------------------------------------------------------------- sampling filters


def ordered(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (the filters' thresholds are keys of this order)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _bisect(ok, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """The smallest uint32 t in (lo, hi] with ok(t), per row, for ok monotone
    (false up to some t, true from it on) with ok(lo) false and ok(hi) true."""
    def body(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        good = ok(mid)
        return jnp.where(good, lo, mid), jnp.where(good, mid, hi)

    return jax.lax.fori_loop(0, 32, body, (lo, hi))[1]


def kth_largest_key(x: jax.Array, k: jax.Array, *, impl: str) -> jax.Array:
    """x [..., V] float32, k [...] int32 -> [..., 1] uint32: the `ordered` key of each row's
    k-th largest value (where k <= 0 or k >= V: the smallest, which keeps every value).
    Native: a vectorised bisection; XLA: 32 halvings, a reduction over the row each."""
    if is_native(impl):
        return cpu.kth_largest_key(x, k)[..., None]
    keys, v = ordered(x), x.shape[-1]
    want = jnp.where((k <= 0) | (k >= v), v, k)[..., None]
    # One above the k-th largest key: the smallest t with fewer than k keys >= t.
    few = lambda t: jnp.sum(keys >= t, axis=-1, keepdims=True) < want
    return _bisect(few, jnp.zeros_like(keys[..., :1]), jnp.max(keys, axis=-1, keepdims=True) + 1) - 1


def top_p_cut_key(probs: jax.Array, p: jax.Array, *, impl: str) -> jax.Array:
    """probs [..., V] float32, p [...] float32 -> [..., 1] uint32: the `ordered` key of the
    smallest probability whose strictly larger ones hold less than p of the row's mass
    (ties kept together)."""
    if is_native(impl):
        return cpu.top_p_cut_key(probs, p)[..., None]
    keys = ordered(probs)
    # The smallest t whose mass above is below p (mass above t falls as t grows).
    light = lambda t: jnp.sum(jnp.where(keys > t, probs, 0.0), axis=-1, keepdims=True) < p[..., None]
    return _bisect(light, ordered(jnp.zeros_like(probs[..., :1])), jnp.max(keys, axis=-1, keepdims=True))


# ----------------------------------------------------------------------------- attention, KV cache


def attends_natively(impl: str, t: int, head_dim: int, fused_groups: int) -> bool:
    """Whether attention over t new tokens per row runs in the native CPU kernel: decode
    and verify steps; prefill chunks (long t), other head sizes and q|k|v in groups
    (`fused_groups`) attend through XLA (`models.layers.attend_after_write`)."""
    return is_native(impl) and t <= cpu.MAX_ATTENTION_TOKENS and head_dim in (64, 128) and fused_groups == 1


def attention(qkv, cos, sin, k_cache, v_cache, layer, lengths, new_mask, *, num_heads: int, qk_norm=None,
              eps: float = 1e-6, slot_mask=None):
    """The native attention (where `attends_natively`): RoPE on q and k, the new K/V written
    in place, attention over the live slots. See `kernels.cpu.attention`."""
    return cpu.attention(qkv, cos, sin, k_cache, v_cache, layer, lengths, new_mask, num_heads=num_heads,
                         qk_norm=qk_norm, eps=eps, slot_mask=slot_mask)


def cache_write(k, v, lengths, layer, k_new, v_new, *, impl: str):
    """Store k_new/v_new [L', B, T, Hkv, D] at slots lengths[b] + t of layers layer ..
    layer + L' - 1 of k/v [L, Bc, Hkv, S, D] -> (k, v). Native: copied in place; XLA: a
    scatter of the values' bits. Both are differentiated as the float scatter."""
    write = _native_write if is_native(impl) else _xla_write
    return write(k, v, lengths, jnp.asarray(layer, jnp.int32), k_new, v_new)


def cache_compact(k, v, lengths, src, n, *, impl: str):
    """For each row b and j < n[b], copy slot lengths[b] + src[b, j] to lengths[b] + j (all
    sources read first): k/v [L, B, Hkv, S, D], src [B, A] -> (k, v)."""
    if is_native(impl):
        return cpu.cache_compact(k, v, lengths, src, n)
    a, max_len, batch = src.shape[1], k.shape[3], k.shape[1]
    base = lengths[:, None]
    src_slot = jnp.clip(base + src, 0, max_len - 1)[:, None, :]  # [B, 1, A]
    dst_slot = jnp.where(jnp.arange(a)[None] < n[:, None], base + jnp.arange(a)[None], max_len)[:, None, :]
    rows = jnp.arange(batch)[:, None, None]
    heads = jnp.arange(k.shape[2])[None, :, None]

    def move(buf):  # buf [L, B, Hkv, S, D]
        picked = buf[:, rows, heads, src_slot]  # [L, B, Hkv, A, D]
        return buf.at[:, rows, heads, dst_slot].set(picked, mode="drop")

    return move(k), move(v)


def cache_rows_in_place(impl: str) -> bool:
    """Whether the cache ops touch only the rows `lengths` counts (native: a cache of the
    first n rows is a view of the whole buffers; XLA: a copy of those rows)."""
    return is_native(impl)


def _write_slots(lengths: jax.Array, t: int) -> jax.Array:
    return lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]


def _scatter_write(k, v, lengths, layer, k_new, v_new, *, as_bits=False):
    """The cache write as an XLA scatter. `as_bits` scatters the values' bits as unsigned
    integers (no gradient: `_with_scatter_gradient` adds the float scatter's): XLA:CPU runs a
    bf16 scatter by converting the whole cache to f32 and back, which the models' one write
    per layer would do L times a forward."""
    slots = _write_slots(lengths, k_new.shape[2])[None, :, None, :]  # [1, B, 1, T]
    layers = (layer + jnp.arange(k_new.shape[0], dtype=jnp.int32))[:, None, None, None]
    rows = jnp.arange(k_new.shape[1])[None, :, None, None]
    heads = jnp.arange(k.shape[2])[None, None, :, None]

    def put(buf, new):  # new -> [L', B, Hkv, T, D]
        new = new.transpose(0, 1, 3, 2, 4).astype(buf.dtype)
        if not as_bits:
            return buf.at[layers, rows, heads, slots].set(new, mode="drop")
        bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * buf.dtype.itemsize}"))
        out = bits(buf).at[layers, rows, heads, slots].set(bits(new), mode="drop")
        return jax.lax.bitcast_convert_type(out, buf.dtype)

    return put(k, k_new), put(v, v_new)


def _with_scatter_gradient(write):
    """`write(k, v, lengths, layer, k_new, v_new) -> (k, v)`, differentiated as the
    float XLA scatter (`_scatter_write`)."""
    def bwd(res, g):
        k, v, lengths, layer, k_new, v_new = res
        _, vjp = jax.vjp(lambda k, v, kn, vn: _scatter_write(k, v, lengths, layer, kn, vn), k, v, k_new, v_new)
        dk, dv, dkn, dvn = vjp(g)
        return dk, dv, None, None, dkn, dvn

    differentiable = jax.custom_vjp(write)
    differentiable.defvjp(lambda *args: (write(*args), args), bwd)
    return differentiable


_native_write = _with_scatter_gradient(
    lambda k, v, lengths, layer, k_new, v_new: cpu.cache_write(k, v, lengths, k_new, v_new, layer))
_xla_write = _with_scatter_gradient(functools.partial(_scatter_write, as_bits=True))


# ----------------------------------------------------------------------------- weights


def pack_weights(ws) -> list:
    """Weights [K, N] packed for the native kernels' matmuls (`kernels.cpu.PackedWeight`)."""
    return cpu.pack_weights(ws)
