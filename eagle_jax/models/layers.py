"""Pieces shared by the target's decoder layers and the drafter's one layer."""

from __future__ import annotations

import jax
from flax import nnx

from eagle_jax.cache import KVCache, written_mask
from eagle_jax.kernels import ops
from eagle_jax.nn import apply_rope, attention, rms_norm


def set_params(module: nnx.Module, weights: dict, axes: dict[str, tuple[str, ...]], drop: int = 0) -> None:
    """Each weight as an attribute `nnx.Param` of `module` carrying its logical axes,
    `axes[name]` without its first `drop` names (`sharding.RULES` maps them onto a
    mesh). A value may be a host array, an abstract shape or a packed weight: nothing
    is placed here (`sharding.shard_model` places parameters, shard by shard)."""
    for name, value in weights.items():
        if name not in axes:
            raise ValueError(f"{type(module).__name__} has no parameter {name!r} (docs/PARAMS.md lists them)")
        setattr(module, name, nnx.Param(value, out_sharding=axes[name][drop:], eager_sharding=False))


def param_values(module: nnx.Module) -> dict:
    """{attribute name: value} of a module's own parameters (not its submodules')."""
    return {name: v.get_value() for name, v in vars(module).items() if isinstance(v, nnx.Param)}


def attend_after_write(q, k, v, cache: KVCache, layer, slot_mask, new_mask, *, impl: str = "auto"):
    """The XLA attention of T new tokens, K/V written first: q [B,T,Hq,D], k/v
    [B,T,Hkv,D] -> (out [B,T,Hq,D], cache with k/v at slots lengths + t of
    `layer`). Each query sees the slots of `slot_mask` [B,T,S] (written before
    this call) and, of the T it writes, those `new_mask` [B,T,T] allows.

    A new key whose slot is past the cache end is dropped with its write and
    seen by no query (the native kernel still attends it); the engines size
    their caches so that it does not happen.

    Writing first keeps the cache in place: every read of the layer follows the
    one write into it. Reading the old cache beside a write into the same
    buffer leaves the two unordered, and XLA then copies the whole cache
    (each draft level of the drafter; twice a step each of the target's K and V
    when its layers are unrolled)."""
    written = cache.write(k[None], v[None], layer=layer, impl=impl)
    visible = slot_mask | written_mask(cache.lengths, cache.max_len, new_mask)
    return attention(q, written.k[layer], written.v[layer], visible), written


def split_heads(qkv: jax.Array, num_heads: int, num_kv_heads: int, head_dim: int, groups: int = 1):
    """qkv [B, T, (Hq + 2 Hkv) D] -> q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D]; the columns
    in `groups` groups of [q | k | v] (the config's `fused_groups`)."""
    b, t, _ = qkv.shape
    hq, hkv = num_heads // groups, num_kv_heads // groups
    g = qkv.reshape(b, t, groups, (hq + 2 * hkv) * head_dim)
    q = g[..., :hq * head_dim].reshape(b, t, num_heads, head_dim)
    k = g[..., hq * head_dim:(hq + hkv) * head_dim].reshape(b, t, num_kv_heads, head_dim)
    v = g[..., (hq + hkv) * head_dim:].reshape(b, t, num_kv_heads, head_dim)
    return q, k, v


def rotate_qk(q, k, cos, sin, *, q_norm=None, k_norm=None, eps=1e-6):
    """Qwen3's per-head norms (when given), then RoPE: q [B,T,Hq,D], k [B,T,Hkv,D]; cos/sin [B,T,D]."""
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
        k = rms_norm(k, k_norm, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def rotated_heads(cfg, qkv, cos, sin, *, q_norm=None, k_norm=None, eps=1e-6):
    """The XLA path of what the native attention does first: qkv [B,T,(Hq+2Hkv)*D],
    cos/sin [B,T,D] -> q [B,T,Hq,D], k and v [B,T,Hkv,D], q and k rotated
    (`rotate_qk`); cfg gives num_heads, num_kv_heads, head_dim."""
    q, k, v = split_heads(qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.fused_groups)
    q, k = rotate_qk(q, k, cos, sin, q_norm=q_norm, k_norm=k_norm, eps=eps)
    return q, k, v


def swiglu_mlp(h, norm_w, w_gate_up, w_down, *, eps, groups=1, impl="auto"):
    """h + down(silu(gate(n)) * up(n)) with n = rms_norm(h): the MLP block with
    its residual; the norm is fused into gate/up, the residual add into down.
    groups: the config's `fused_groups` ([gate | up] in that many column groups)."""
    return ops.matmul(ops.norm_swiglu(h, norm_w, w_gate_up, eps=eps, groups=groups, impl=impl), w_down,
                      residual=h, impl=impl)
