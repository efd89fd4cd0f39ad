"""What impl="auto" resolves to per backend (issue 20): Pallas on TPU, XLA on GPU
until the Mosaic GPU kernel is measured faster there, native or XLA on CPU."""

import jax
import pytest

from eagle_jax.kernels import auto_impl, cpu, resolve_impl
ENV_VAR = "EAGLE_JAX_KERNEL_IMPL"


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)

    def set_backend(name):
        monkeypatch.setattr(jax, "default_backend", lambda: name)

    return set_backend


@pytest.mark.parametrize("name", ["gpu", "cuda", "rocm"])
def test_auto_is_xla_on_gpu(backend, name):
    backend(name)
    assert auto_impl(name) == "xla"
    assert resolve_impl("auto") == "xla"


def test_auto_is_pallas_on_tpu(backend):
    backend("tpu")
    assert resolve_impl("auto") == "pallas"


@pytest.mark.parametrize("loads", [True, False])
def test_auto_on_cpu_follows_the_native_library(backend, monkeypatch, loads):
    backend("cpu")
    monkeypatch.setattr(cpu, "available", lambda: loads)
    assert resolve_impl("auto") == ("native" if loads else "xla")


def test_explicit_impls_and_the_env_override_are_kept(backend, monkeypatch):
    backend("gpu")
    assert resolve_impl("pallas") == "pallas"
    monkeypatch.setenv(ENV_VAR, "pallas")
    assert resolve_impl("auto") == "pallas"
    monkeypatch.setenv(ENV_VAR, "triton")
    with pytest.raises(ValueError, match=r"unknown kernel impl 'triton' \(from \$EAGLE_JAX_KERNEL_IMPL\)"):
        resolve_impl("auto")
