"""Multi-head latent attention (DeepSeek-V3, Kimi K2) over a compressed KV cache.

Used by the MLA target's layers (`mla_attention`) and by an MLA drafter's layer
(`models.drafter`, `DrafterConfig.mla`), whose projections read its 2H input
(`latent_attention_block`). `cfg` below is either config: both carry `mla`, `rope`
and `num_heads`.

Layer parameters (docs/PARAMS.md, one layer's), with h heads, R = kv_lora_rank,
Dn / Dr / Dv = qk_nope / qk_rope / v head dims and QA = q_lora_rank (or h (Dn+Dr)
without a query low-rank projection), X the projections' input width (H; 2H in a
drafter):
  `wqkv_a` [X, QA + R + Dr]: [q_a | kv_a] (q_a: HF q_a_proj, or q_proj when
      q_lora_rank is None; kv_a: kv_a_proj_with_mqa, the latent then the rope key);
  `q_a_norm` [QA], `wq_b` [QA, h (Dn + Dr)] (with a q_lora_rank only);
  `kv_a_norm` [R]; `wkv_b` [R, h (Dn + Dv)] (per head: W_UK's Dn columns, then
      W_UV's Dv); `wo` [h Dv, H].
With `MLAConfig.rope_interleave` the rope columns of q and of kv_a hold
interleaved pairs; `rotate` de-interleaves them before the rotate-half RoPE of
`nn.apply_rope` (q and k alike, so the scores are those of rotating the pairs).

The cache (`create_cache`) holds per token, per layer, the normed latent c [R]
(`KVCache.k`, one "head") and the rotated rope key [Dr] (`KVCache.v`): not the
per-head K/V. Every forward (prefill, decode, verify) attends from the latent
(`nn.latent_attention`): W_UK folded into the query, W_UV applied to the
softmax-weighted latents; exact up to float rounding, as vLLM's and SGLang's MLA
decode. (For long prefills expanding K/V would take fewer flops; one path keeps
prefill and decode the same computation.)

On a mesh (`sharding.RULES`) the heads split over the model axis: wq_b's and wkv_b's
columns and wo's rows, whole heads a shard where the axis divides them, so each
device attends with its own heads from the whole latent cache (replicated over the
model axis: it has no head axis; its rows split over data as the dense cache's), and
o_proj's partial sums meet in one all-reduce. wqkv_a (the down-projections) is
replicated: every device computes the latent and the rope key it caches.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from eagle_jax.cache import KVCache, committed_mask, written_mask
from eagle_jax.config import DrafterConfig, MLAConfig, TargetConfig
from eagle_jax.kernels import ops
from eagle_jax.nn import apply_rope, latent_attention, rms_norm
from eagle_jax.sharding import RULES


def create_cache(m: MLAConfig, num_layers: int, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """k: the latents [L, B, 1, S, R]; v: the rope keys [L, B, 1, S, Dr]."""
    return KVCache(k=jnp.zeros((num_layers, batch, 1, max_len, m.kv_lora_rank), dtype),
                   v=jnp.zeros((num_layers, batch, 1, max_len, m.qk_rope_head_dim), dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))


def softmax_scale(cfg: TargetConfig | DrafterConfig) -> float:
    """(Dn + Dr)^-1/2, times mscale(factor, mscale_all_dim)^2 under a scaled rope
    (transformers' `yarn_apply_mscale`, DeepSeek's softmax_scale)."""
    m, rope = cfg.mla, cfg.rope
    scale = m.qk_head_dim ** -0.5
    if rope.scaling_type is not None and m.mscale_all_dim and rope.factor > 1:
        mscale = 0.1 * m.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


def rotate(cfg: TargetConfig | DrafterConfig, x, cos, sin):
    """RoPE on the rope columns x [B, T, heads, Dr] (cos/sin [B, T, Dr]), interleaved
    pairs first laid out as [evens | odds] where `rope_interleave`."""
    if cfg.mla.rope_interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, cos, sin)


def latent_attention_block(p: dict, cfg: TargetConfig | DrafterConfig, qkv_a, cos, sin, cache: KVCache, layer,
                           slot_mask, new_mask, *, impl: str = "auto"):
    """MLA of T new tokens from their [q_a | kv_a] projection, before o_proj:
    qkv_a [B, T, QA + R + Dr], cos/sin [B, T, Dr] -> (out [B, T, h Dv], cache with the
    tokens' normed latents and rotated rope keys written at slots lengths + t of `layer`).
    Each query sees the slots of `slot_mask` [B, T, S] (written before this call) and, of
    the T it writes, those `new_mask` [B, T, T] allows (`layers.attend_after_write`'s rule)."""
    m = cfg.mla
    b, t, _ = qkv_a.shape
    heads, r, dn, dr, dv = cfg.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    q, latent, k_rope = jnp.split(qkv_a, [qkv_a.shape[-1] - r - dr, qkv_a.shape[-1] - dr], axis=-1)
    if m.q_lora_rank is not None:
        q = ops.fused_norm_matmul(q, p["q_a_norm"], p["wq_b"], eps=m.norm_eps, impl=impl,
                                  column_axis=RULES["mla_q"])
    q = q.reshape(b, t, heads, dn + dr)
    q_nope, q_rope = q[..., :dn], rotate(cfg, q[..., dn:], cos, sin)
    latent = rms_norm(latent, p["kv_a_norm"], m.norm_eps)
    k_rope = rotate(cfg, k_rope[:, :, None, :], cos, sin)  # [B, T, 1, Dr]

    written = cache.write(latent[None, :, :, None, :], k_rope[None], layer=layer, impl=impl)
    visible = slot_mask | written_mask(cache.lengths, cache.max_len, new_mask)
    wkv_b = p["wkv_b"].astype(qkv_a.dtype).reshape(r, heads, dn + dv)
    q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, wkv_b[..., :dn], preferred_element_type=jnp.float32)
    out = latent_attention(q_latent.astype(qkv_a.dtype), q_rope, written.k[layer], written.v[layer], visible,
                           softmax_scale(cfg))
    out = jnp.einsum("bthr,rhv->bthv", out, wkv_b[..., dn:], preferred_element_type=jnp.float32)
    return out.astype(qkv_a.dtype).reshape(b, t, heads * dv), written


def mla_attention(p: dict, cfg: TargetConfig, h, cos, sin, cache: KVCache, layer, new_mask, *,
                  impl: str = "auto"):
    """A target layer's h + o_proj(MLA(rms_norm(h))) for T new tokens: h [B, T, H],
    cos/sin [B, T, Dr], new_mask [B, T, T] -> (h, cache with the tokens' latents and rope
    keys written at slots lengths + t of `layer`). Each query sees the committed slots
    and the new ones `new_mask` allows."""
    qkv_a = ops.fused_norm_matmul(h, p["attn_norm"], p["wqkv_a"], eps=cfg.rms_norm_eps, impl=impl,
                                  column_axis=RULES["mla_a"])
    slot_mask = committed_mask(cache.lengths, cache.max_len, h.shape[1])
    out, written = latent_attention_block(p, cfg, qkv_a, cos, sin, cache, layer, slot_mask, new_mask, impl=impl)
    return ops.matmul(out, p["wo"], residual=h, impl=impl), written
