"""Fused RMSNorm + projection kernels (`eagle_jax.kernels`).

`fused_norm_matmul` is the single entry point; `impl` selects the XLA
reference path or a Pallas lowering (Mosaic on TPU, Triton on GPU, or either
kernel body under the Pallas interpreter). `fold_norm_into_weight` folds the
norm gains into a weight once, for repeated (decode) calls.
"""

from eagle_jax.kernels.fused_norm_matmul import (
    FoldedWeight,
    fold_norm_into_weight,
    fused_norm_matmul,
    rms_norm_matmul_reference,
)

__all__ = ["FoldedWeight", "fold_norm_into_weight", "fused_norm_matmul", "rms_norm_matmul_reference"]
