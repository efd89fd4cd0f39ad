"""Fused RMSNorm + projection kernels (`eagle_jax.kernels`).

`fused_norm_matmul` is the single entry point; `impl` selects the XLA
reference path, the native CPU kernels (`cpu`, on weights packed once) or a
Pallas lowering (Mosaic on TPU, Mosaic GPU on GPU, or either kernel body under
the Pallas interpreter); ``"auto"`` (`auto_impl`) is Pallas on TPU, XLA on
GPU (until Pallas is measured faster there), native or XLA on CPU. `matmul`
is the plain projection on the same weights. Every path takes the trained
weights as they are (the native ones after a one-time packing): the norm
gains always scale the activations, never the weight.

`ops` is the facade the rest of the package calls: every op (these, attention,
embedding, argmax, the cache write and compaction, the sampling filters) on an
impl resolved once (`ops.resolve`); nothing outside this package imports `cpu`.
"""

from eagle_jax.kernels.cpu import PackedWeight, pack_weight, pack_weights
from eagle_jax.kernels.fused_norm_matmul import (
    LayerWeight,
    auto_impl,
    fused_norm_matmul,
    matmul,
    norm_swiglu,
    resolve_impl,
    rms_norm_matmul_reference,
)

__all__ = ["LayerWeight", "PackedWeight", "auto_impl", "fused_norm_matmul", "matmul", "norm_swiglu", "pack_weight",
           "pack_weights", "resolve_impl", "rms_norm_matmul_reference"]
