"""Grouped-query attention of T queries over a cache block, and multi-head latent
attention (MLA) over a compressed one.

The keys are the cache [B, Hkv, S, D] (heads before slots: the layout that
makes q.K a contiguous batched matmul on CPU); a mask [B, T, S] says which
slots each query sees. The models write the new tokens' K/V into the cache
first and then attend over it (`models.layers.attend_after_write`).
"""

import jax.numpy as jnp


def _masked_softmax(scores, mask):
    """Softmax over the last axis of float32 `scores` where `mask` (broadcast to them) is
    True; a row that sees nothing is all 0."""
    scores = jnp.where(mask, scores, -jnp.inf)
    peak = jnp.max(scores, -1, keepdims=True)
    weights = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
    denom = jnp.sum(weights, -1, keepdims=True)
    return weights * (1.0 / jnp.where(denom > 0, denom, 1.0))


def attention(q, k_cache, v_cache, mask):
    """Scaled dot-product attention, softmax in float32.

    q [B, T, Hq, D]; k_cache/v_cache [B, Hkv, S, D]; mask [B, T, S] (True = may attend).
    Returns [B, T, Hq, D] in q.dtype; a query that sees nothing returns 0.
    """
    b, t, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    # [B, Hkv, g*T, D] with rows ordered (g, t); the mask the same: [B, 1, g*T, S]
    qh = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    mask = jnp.broadcast_to(mask[:, None, None], (b, 1, g) + mask.shape[1:]).reshape(b, 1, g * t, -1)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    scores = jnp.einsum("bkqd,bksd->bkqs", qh, k_cache.astype(q.dtype), preferred_element_type=jnp.float32)
    weights = _masked_softmax(scores * scale, mask)
    out = jnp.einsum("bkqs,bksd->bkqd", weights.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
    return out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q.dtype)


def latent_attention(q_latent, q_rope, latent_cache, rope_cache, mask, scale: float):
    """MLA attention read straight from its compressed cache, softmax in float32.

    With W_UK folded into the query (q_latent = q_nope . W_UK per head), a head's
    score for slot s is q_latent . c_s + q_rope . k_rope_s, the same as q . k_s of
    the expanded keys; the result is the softmax-weighted latents, which W_UV turns
    into the head's values.

    q_latent [B, T, Hq, R]; q_rope [B, T, Hq, Dr]; latent_cache [B, 1, S, R];
    rope_cache [B, 1, S, Dr]; mask [B, T, S] (True = may attend); scale: the softmax
    scale. Returns [B, T, Hq, R] in q_latent.dtype; a query that sees nothing returns 0.
    """
    c, k_rope = latent_cache[:, 0].astype(q_latent.dtype), rope_cache[:, 0].astype(q_rope.dtype)
    scores = (jnp.einsum("bthr,bsr->bhts", q_latent, c, preferred_element_type=jnp.float32)
              + jnp.einsum("bthd,bsd->bhts", q_rope, k_rope, preferred_element_type=jnp.float32))
    weights = _masked_softmax(scores * scale, mask[:, None])
    out = jnp.einsum("bhts,bsr->bthr", weights.astype(c.dtype), c, preferred_element_type=jnp.float32)
    return out.astype(q_latent.dtype)
