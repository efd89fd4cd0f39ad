"""Process-level settings (eagle_jax/runtime.py): the persistent compilation cache switch."""

from __future__ import annotations

import jax

from eagle_jax.runtime import enable_compilation_cache


def test_the_compilation_cache_is_off_when_the_variable_says_off(monkeypatch, tmp_path):
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("EAGLE_JAX_XLA_CACHE", "off")
    assert enable_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir == before
    try:  # an explicit directory still turns it on
        assert enable_compilation_cache(str(tmp_path / "xla")) == str(tmp_path / "xla")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla") and (tmp_path / "xla").is_dir()
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
