"""benchmarks/draft_vocab.py: the coverage half (the step timing is a measurement only)."""

from __future__ import annotations

import json

from eagle_jax.benchmarks import draft_vocab as dv
from eagle_jax.train import data

ANSWERS = ["The capital of France is Paris.", "Two plus two is four, and four plus four is eight.",
           "def square(x):\n    return x * x"]


def test_coverage_of_held_out_answers(smollm2_target, tmp_path):
    ids = [f"dv{i}_0" for i in range(400)]
    held = [i for i in ids if data.is_heldout(i)][:3]
    train = [i for i in ids if not data.is_heldout(i)][:3]
    assert len(held) == len(train) == 3
    # the same answers under training and held-out ids: a vocabulary holding every
    # training token covers the held-out answers completely
    lines = [{"id": i, "messages": [{"role": "user", "content": f"Question {n}?"},
                                    {"role": "assistant", "content": a}]}
             for group in (train, held) for n, (i, a) in enumerate(zip(group, ANSWERS))]
    path = tmp_path / "regen.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    vocab = smollm2_target.cfg.vocab_size
    out = dv.coverages(str(path), (1, 8, 4096, vocab))
    assert out["conversations"] == [3, 3] and out["train_tokens"] == out["heldout_tokens"] > 20
    cov = [out["sizes"][v]["coverage"] for v in (1, 8, 4096, vocab)]
    assert 0.0 < cov[0] <= cov[1] <= cov[2] == cov[3] == 1.0
    assert out["sizes"][8]["train_coverage"] == cov[1]  # the same text in both splits
    assert out["sizes"]["shipped"]["size"] == 16384 and 0.0 < out["sizes"]["shipped"]["coverage"] <= 1.0
