"""Fused RMSNorm + projection kernels (`eagle_jax.kernels`).

`fused_norm_matmul` is the single entry point; `impl` selects the XLA
reference path or a Pallas lowering.
"""

from eagle_jax.kernels.fused_norm_matmul import fused_norm_matmul, rms_norm_matmul_reference

__all__ = ["fused_norm_matmul", "rms_norm_matmul_reference"]
