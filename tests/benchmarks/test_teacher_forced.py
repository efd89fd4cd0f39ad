"""benchmarks/teacher_forced.py on the real target and the bundled EAGLE 3.1 drafter (small sizes)."""

from __future__ import annotations

import json

from eagle_jax.benchmarks import teacher_forced as tf
from eagle_jax.convert.bundled import bundled_path
from eagle_jax.generate import Generator
from eagle_jax.train import data


def test_same_text_same_accuracy_in_both_sets(smollm2_target, tmp_path):
    t = smollm2_target
    gen = Generator(t.cfg, t.params, t.tokenizer)
    held = tf.heldout_answers(gen, 3, 24, 256, 0.02)
    assert len(held) == 3 and all(c["messages"][-1]["role"] == "assistant" for c in held)
    # the same target-written answers, filed under training ids: both sets hold the same text
    train_ids = [f"tf{i}_0" for i in range(200) if not data.is_heldout(f"tf{i}_0")][:3]
    path = tmp_path / "regen.jsonl"
    path.write_text("".join(json.dumps({"id": i, "messages": c["messages"]}) + "\n"
                            for i, c in zip(train_ids, held)))
    out = tmp_path / "tf.json"
    draft = bundled_path("smollm2-135m-eagle3.1")
    assert tf.main(["--data", str(path), "--draft", draft, "--num", "3", "--max-new-tokens", "24",
                    "--seq-len", "384", "--output", str(out)]) == 0
    r = json.loads(out.read_text())["drafters"][draft]
    assert r["train"] == r["heldout"]
    assert r["train"]["response_tokens"] >= 60 and r["train"]["conversations"] == 3
    for s, v in zip(r["train"]["strict"], r["train"]["in_vocab"]):
        assert 0.0 <= s <= v <= 1.0
    assert r["train"]["strict"][0] > 0.1  # a trained drafter predicts the target's own text


def test_chain_tau_by_hand():
    """k = 3; one answer at [4, 10): the root x_4 is the target's; step 1 rooted at t = 3 accepts
    x_5, x_6 (hits of steps 0, 1 at t = 3), misses x_7 and emits the target's x_7; step 2 rooted at
    t = 6 has x_8, x_9 left: accepts both and stops at the answer's end. A second answer at [12, 14)
    with no hits takes one step per token."""
    import numpy as np

    hits = np.zeros((3, 16), bool)
    hits[0, 3] = hits[1, 3] = True
    hits[0, 6] = hits[1, 6] = hits[2, 6] = True
    hits[:, 4] = hits[:, 5] = True  # inside an accepted span: no chain is rooted there
    mask = np.zeros(16, np.int32)
    mask[4:10] = 1
    mask[12:14] = 1
    assert tf.chain_tau(hits, mask) == (5 + 1, 2 + 1)
    assert tf.chain_tau(np.zeros((3, 16), bool), mask) == (6, 6)
