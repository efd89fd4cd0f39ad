"""Session fixtures for engine tests."""

import pytest


@pytest.fixture(scope="session")
def smollm2():
    from eagle_jax.convert.registry import load_target

    return load_target("smollm2-135m-instruct", dtype="float32")
