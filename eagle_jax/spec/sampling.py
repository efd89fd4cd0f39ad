"""Logit processing (temperature, top-k, top-p) and token sampling.

The same processing is applied to target and draft logits, so acceptance
compares the two distributions the user asked for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax.config import SamplingConfig


def process_logits(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """logits [..., V] -> filtered, temperature-scaled logits (-inf outside the kept set)."""
    x = logits.astype(jnp.float32) / max(sampling.temperature, 1e-6)
    if sampling.top_k and sampling.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, sampling.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        keep_sorted = before < sampling.top_p  # always keeps the most likely token
        keep = jnp.zeros_like(keep_sorted).at[
            tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
        x = jnp.where(keep, x, -jnp.inf)
    return x


def probabilities(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Processed distribution [..., V] (float32, sums to 1)."""
    return jax.nn.softmax(process_logits(logits, sampling), axis=-1)


def sample(key, logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """One token per row of logits [..., V]: argmax when greedy, else a draw."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, process_logits(logits, sampling), axis=-1).astype(jnp.int32)


def sample_probs(key, probs: jax.Array) -> jax.Array:
    """Draw from explicit probabilities [..., V] (may be unnormalised, >= 0)."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
