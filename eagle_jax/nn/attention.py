"""Grouped-query attention over an explicit boolean mask."""

import jax
import jax.numpy as jnp


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Scaled dot-product attention, softmax in float32.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D]; mask [B, T, S] bool (True = may attend).
    Returns [B, T, Hq, D] in q.dtype. Rows whose mask is all False return 0.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(d)))
    m = mask[:, None, None, :, :]
    scores = jnp.where(m, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.where(m, jnp.exp(scores - peak), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)
