"""Pure building blocks shared by the target and the drafter."""

from eagle_jax.nn.attention import attention, latent_attention
from eagle_jax.nn.norm import rms_norm
from eagle_jax.nn.rope import apply_rope, rope_tables

__all__ = ["attention", "latent_attention", "rms_norm", "apply_rope", "rope_tables"]
