"""Process-level settings: default dtype per backend, persistent compilation cache."""

from __future__ import annotations

import os

import jax


def default_dtype() -> str:
    """float32 on CPU, bfloat16 on GPU and TPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def enable_compilation_cache(path: str | None = None) -> str:
    """Turn on JAX's persistent compilation cache (warm starts skip XLA compiles).

    Location: `path`, else $EAGLE_JAX_XLA_CACHE, else ~/.cache/eagle_jax/xla.
    """
    path = path or os.environ.get("EAGLE_JAX_XLA_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "eagle_jax", "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
