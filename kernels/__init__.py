"""Fused RMSNorm + projection kernels (`eagle_jax.kernels`).

`fused_norm_matmul` is the single entry point; `impl` selects the XLA
reference path, the native CPU kernels (`cpu`, on weights packed once) or a
Pallas lowering (Mosaic on TPU, Triton on GPU, or either kernel body under
the Pallas interpreter); ``"auto"`` (`auto_impl`) is Pallas on TPU, XLA on
GPU (until Pallas is measured faster there), native or XLA on CPU. `matmul`
is the plain projection on the same weights. `fold_norm_into_weight` folds
the norm gains into a weight once, for repeated (decode) calls.
"""

from eagle_jax.kernels.cpu import PackedWeight, pack_weight
from eagle_jax.kernels.fused_norm_matmul import (
    FoldedWeight,
    auto_impl,
    fold_norm_into_weight,
    fused_norm_matmul,
    matmul,
    norm_swiglu,
    resolve_impl,
    rms_norm_matmul_reference,
)

__all__ = ["FoldedWeight", "PackedWeight", "auto_impl", "fold_norm_into_weight", "fused_norm_matmul", "matmul",
           "norm_swiglu", "pack_weight", "resolve_impl", "rms_norm_matmul_reference"]
