"""Grouped-query attention of T queries over a cache block.

The keys are the cache [B, Hkv, S, D] (heads before slots: the layout that
makes q.K a contiguous batched matmul on CPU); a mask [B, T, S] says which
slots each query sees. The models write the new tokens' K/V into the cache
first and then attend over it (`models.layers.attend_after_write`).
"""

import jax.numpy as jnp


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
    scores = jnp.where(mask, scores * scale, -jnp.inf)
    peak = jnp.max(scores, -1, keepdims=True)
    weights = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
    denom = jnp.sum(weights, -1, keepdims=True)
    weights = weights * (1.0 / jnp.where(denom > 0, denom, 1.0))
    out = jnp.einsum("bkqs,bksd->bkqd", weights.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
    return out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q.dtype)
