"""Grouped-query attention over a read-only cache block plus the new tokens.

Keys come in two blocks with one joint softmax: the cache [B, Hkv, S, D]
(heads before slots: the layout that makes q.K a contiguous batched matmul on
CPU) and the T new tokens [B, T, Hkv, D]. Nothing is concatenated or written
here; the caller stores the new K/V afterwards.
"""

import jax
import jax.numpy as jnp


def attention(q, k_cache, v_cache, cache_mask, k_new, v_new, new_mask):
    """Scaled dot-product attention, softmax in float32.

    q [B, T, Hq, D]; k_cache/v_cache [B, Hkv, S, D]; cache_mask [B, T, S];
    k_new/v_new [B, T, Hkv, D]; new_mask [B, T, T] (True = may attend).
    Returns [B, T, Hq, D] in q.dtype; a query that sees nothing returns 0.
    """
    b, t, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    # [B, Hkv, g*T, D] with rows ordered (g, t)
    qh = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    kn = k_new.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    vn = v_new.transpose(0, 2, 1, 3)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    s_cache = jnp.einsum("bkqd,bksd->bkqs", qh, k_cache.astype(q.dtype), preferred_element_type=jnp.float32)
    s_new = jnp.einsum("bkqd,bksd->bkqs", qh, kn, preferred_element_type=jnp.float32)

    def expand(mask):  # [B, T, X] -> [B, 1, g*T, X]
        return jnp.broadcast_to(mask[:, None, None], (b, 1, g) + mask.shape[1:]).reshape(b, 1, g * t, -1)

    mc, mn = expand(cache_mask), expand(new_mask)
    s_cache = jnp.where(mc, s_cache * scale, -jnp.inf)
    s_new = jnp.where(mn, s_new * scale, -jnp.inf)
    peak = jnp.maximum(jnp.max(s_cache, -1, keepdims=True), jnp.max(s_new, -1, keepdims=True))
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    w_cache = jnp.where(mc, jnp.exp(s_cache - peak), 0.0)
    w_new = jnp.where(mn, jnp.exp(s_new - peak), 0.0)
    denom = jnp.sum(w_cache, -1, keepdims=True) + jnp.sum(w_new, -1, keepdims=True)
    inv = 1.0 / jnp.where(denom > 0, denom, 1.0)
    out = (jnp.einsum("bkqs,bksd->bkqd", (w_cache * inv).astype(v_cache.dtype), v_cache,
                      preferred_element_type=jnp.float32)
           + jnp.einsum("bkqs,bksd->bkqd", (w_new * inv).astype(vn.dtype), vn,
                        preferred_element_type=jnp.float32))
    return out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q.dtype)
