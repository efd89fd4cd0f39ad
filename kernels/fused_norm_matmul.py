"""fused_norm_matmul: y = concat_s(rms_norm(x_s) * g_s) @ w (+ bias).

Shapes: x [..., K]; norm_weights [K] (one norm) or [S, K//S] (one norm per
segment of the feature axis); w [K, N]; bias [N] or None. Accumulation in
float32; the result has x's dtype.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

IMPLS = ("auto", "xla", "pallas", "interpret")
ENV_VAR = "EAGLE_JAX_KERNEL_IMPL"


def rms_norm_matmul_reference(x, norm_weights, w, *, eps, segments=1, bias=None):
    """Plain-XLA path: normalise each segment in f32, scale, cast, matmul."""
    k = x.shape[-1]
    xs = x.astype(jnp.float32).reshape(*x.shape[:-1], segments, k // segments)
    var = jnp.mean(jnp.square(xs), axis=-1, keepdims=True)
    g = norm_weights.reshape(segments, k // segments)
    normed = (xs * jax.lax.rsqrt(var + eps)).astype(x.dtype) * g.astype(x.dtype)
    normed = normed.reshape(x.shape)
    y = jnp.dot(normed, w.astype(x.dtype), preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def _resolve_impl(impl: str) -> str:
    forced = os.environ.get(ENV_VAR)
    if forced:
        impl = forced
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel impl {impl!r}; expected one of {IMPLS} "
                         f"(from {'$' + ENV_VAR if forced else 'the impl argument'})")
    if impl == "auto":
        impl = "xla" if jax.default_backend() == "cpu" else "pallas"
    return impl


def fused_norm_matmul(x, norm_weights, w, *, eps, segments=1, bias=None, impl="auto"):
    """RMSNorm (per segment) followed by a projection. See module docstring."""
    k = x.shape[-1]
    if w.ndim != 2 or w.shape[0] != k:
        raise ValueError(f"w must be [K={k}, N], got {w.shape}")
    if k % segments:
        raise ValueError(f"K={k} is not divisible into {segments} segments")
    if norm_weights.size != k:
        raise ValueError(f"norm_weights must hold K={k} values, got shape {norm_weights.shape}")
    impl = _resolve_impl(impl)
    if impl == "xla":
        return rms_norm_matmul_reference(x, norm_weights, w, eps=eps, segments=segments, bias=bias)
    raise NotImplementedError(f"kernel impl {impl!r} is not built yet")
