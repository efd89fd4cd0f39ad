"""Streaming yields the same text as batch generation, piece by piece."""

import pytest

from eagle_jax.config import SpecConfig
from eagle_jax.generate import Generator

from spec_helpers import smollm2_random_drafter


def test_stream_equals_generate(smollm2_target):
    d = smollm2_random_drafter(smollm2_target.cfg, "eagle3.1")
    gen = Generator(smollm2_target.cfg, smollm2_target.params, smollm2_target.tokenizer, drafter=d,
                    spec=SpecConfig("chain", num_speculative_tokens=3))
    prompt = "Name three colours."
    stream = gen.stream(prompt, max_new_tokens=20)
    assert stream.finish_reason is None
    pieces = list(stream)
    full = gen.generate([prompt], max_new_tokens=20)
    assert len(pieces) > 1
    assert "".join(pieces) == full.texts[0]
    assert stream.finish_reason == full.finish_reasons[0]


@pytest.fixture(scope="module")
def plain(smollm2_target):
    """One plain generator: its stream engine is made by the first stream and kept."""
    return Generator(smollm2_target.cfg, smollm2_target.params, smollm2_target.tokenizer)


def test_stream_finish_reason_eos(plain):
    gen = plain
    full = gen.generate(["Reply with one word: yes or no?"], max_new_tokens=40)
    assert full.finish_reasons == ["eos"]  # a short answer ends before the budget
    stream = gen.stream("Reply with one word: yes or no?", max_new_tokens=40)
    assert "".join(stream) == full.texts[0] and stream.finish_reason == "eos"


def test_stream_stops_at_stop_string(plain):
    gen = plain
    full = gen.generate(["Count from one to ten in words."], max_new_tokens=30).texts[0]
    words = full.split()
    assert len(words) > 3
    stop = words[2]
    stream = gen.stream("Count from one to ten in words.", max_new_tokens=30, stop=[stop])
    text = "".join(stream)
    assert stop not in text and full.startswith(text) and stream.finish_reason == "stop"
    res = gen.generate(["Count from one to ten in words."], max_new_tokens=30, stop=[stop])
    assert res.texts[0] == text and res.finish_reasons == ["stop"]
