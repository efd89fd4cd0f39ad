"""eagle-jax: EAGLE-3 / EAGLE 3.1 speculative decoding in JAX."""

__version__ = "0.1.0"
