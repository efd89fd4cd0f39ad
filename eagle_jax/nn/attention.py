"""Grouped-query attention over a read-only cache block plus the new tokens.

Keys come in two blocks with one joint softmax: the cache [B, Hkv, S, D]
(heads before slots: the layout that makes q.K a contiguous batched matmul on
CPU) and the T new tokens [B, T, Hkv, D]. Nothing is concatenated or written
here: the caller stores the new K/V afterwards, or before, and then passes
no new block (the cache mask shows the queries their slots).
"""

import functools

import jax.numpy as jnp


def attention(q, k_cache, v_cache, cache_mask, k_new=None, v_new=None, new_mask=None):
    """Scaled dot-product attention, softmax in float32.

    q [B, T, Hq, D]; k_cache/v_cache [B, Hkv, S, D]; cache_mask [B, T, S];
    k_new/v_new [B, T, Hkv, D]; new_mask [B, T, T] (True = may attend); the
    new block is optional (None: the cache alone).
    Returns [B, T, Hq, D] in q.dtype; a query that sees nothing returns 0.
    """
    b, t, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    # [B, Hkv, g*T, D] with rows ordered (g, t)
    qh = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    blocks = [(k_cache.astype(q.dtype), v_cache, cache_mask)]  # keys [B, Hkv, X, D], mask [B, T, X]
    if k_new is not None:
        blocks.append((k_new.transpose(0, 2, 1, 3), v_new.transpose(0, 2, 1, 3), new_mask))
    scale = 1.0 / jnp.sqrt(jnp.float32(d))

    def expand(mask):  # [B, T, X] -> [B, 1, g*T, X]
        return jnp.broadcast_to(mask[:, None, None], (b, 1, g) + mask.shape[1:]).reshape(b, 1, g * t, -1)

    masks = [expand(m) for _, _, m in blocks]
    scores = [jnp.where(m, jnp.einsum("bkqd,bksd->bkqs", qh, kb, preferred_element_type=jnp.float32) * scale,
                        -jnp.inf) for (kb, _, _), m in zip(blocks, masks)]
    peak = functools.reduce(jnp.maximum, [jnp.max(sc, -1, keepdims=True) for sc in scores])
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = [jnp.where(m, jnp.exp(sc - peak), 0.0) for sc, m in zip(scores, masks)]
    denom = sum(jnp.sum(w, -1, keepdims=True) for w in weights)
    inv = 1.0 / jnp.where(denom > 0, denom, 1.0)
    out = sum(jnp.einsum("bkqs,bksd->bkqd", (w * inv).astype(vb.dtype), vb, preferred_element_type=jnp.float32)
              for w, (_, vb, _) in zip(weights, blocks))
    return out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q.dtype)
