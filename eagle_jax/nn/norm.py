"""RMSNorm with HF semantics: variance in float32, `weight * x_normed.astype(dtype)`."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D], weight [D] -> [..., D] in x.dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)
