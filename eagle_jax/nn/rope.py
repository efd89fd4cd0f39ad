"""Rotary position embeddings (HF `rotate_half` layout) with scaling rules.

`inv_frequencies` is computed once on the host (numpy, float64) from the
static RopeConfig; `rope_tables` turns per-token positions into cos/sin.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.config import RopeConfig


def _yarn(rope: RopeConfig, head_dim: int, base_inv: np.ndarray) -> tuple[np.ndarray, float]:
    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
                ) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp  # 1 keeps the original frequency, 0 interpolates
    inv = (base_inv / rope.factor) * (1.0 - extrapolation) + base_inv * extrapolation
    if rope.attention_factor is not None:
        scale = rope.attention_factor
    else:
        scale = 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
    return inv, scale


def inv_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Returns (inv_freq [head_dim // 2] float64, attention scaling of cos/sin)."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind = rope.scaling_type
    if kind is None:
        return inv, 1.0
    if kind == "linear":
        return inv / rope.factor, 1.0
    if kind == "llama3":
        orig = rope.original_max_position_embeddings
        low_wavelen = orig / rope.low_freq_factor
        high_wavelen = orig / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        mid = (1 - smooth) * inv / rope.factor + smooth * inv
        out = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return np.where(is_mid, mid, out), 1.0
    if kind == "yarn":
        return _yarn(rope, head_dim, inv)
    raise AssertionError(kind)  # RopeConfig validates the type


def rope_tables(positions: jax.Array, rope: RopeConfig, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] int -> (cos, sin) each [B, T, head_dim] float32."""
    inv, scale = inv_frequencies(rope, head_dim)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, D]; cos/sin [B, T, D] -> rotated x in x.dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
