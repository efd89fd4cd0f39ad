"""`regenerate`: assistant turns rewritten by the target, resumable, split kept."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle_jax.generate import Generator
from eagle_jax.train import data
from eagle_jax.train.datastore import read_conversations
from eagle_jax.train.regenerate import later_turns, read_done, regenerate

torch = pytest.importorskip("torch")

MAX_NEW = 24
CONVS = [
    {"id": "geo_0", "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "ORIGINAL ANSWER"},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "ORIGINAL SECOND"}]},
    {"id": "py_0", "messages": [
        {"role": "user", "content": "Write a Python function that reverses a string."},
        {"role": "assistant", "content": "ORIGINAL"}]},
    {"id": "long_0", "messages": [
        {"role": "user", "content": "word " * 400},
        {"role": "assistant", "content": "ORIGINAL"}]},
]


def _heldout_conv():
    for n in range(1000):
        cid = f"held{n}_0"
        if data.is_heldout(cid, 0.02):
            return {"id": cid, "messages": [{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "HELD-OUT ORIGINAL"}]}
    raise AssertionError("no held-out id found")


@pytest.fixture(scope="module")
def generator(smollm2_target):
    t = smollm2_target
    return Generator(t.cfg, t.params, t.tokenizer)


def _hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_regenerate_matches_target_greedy_and_resumes(generator, smollm2_hf_model, tmp_path):
    tok = generator.tokenizer
    convs = CONVS + [_heldout_conv()]
    out = tmp_path / "regen.jsonl"
    kw = dict(batch_size=2, max_new_tokens=MAX_NEW, max_prompt_tokens=128, max_turns=2, progress=False)
    stats = regenerate(convs[:2], generator, out, **kw)
    assert stats["conversations"] == 2 and stats["turns"] >= 2
    # a run killed mid-write leaves a torn line: it is cut off and the rest resumes
    with open(out, "a") as f:
        f.write('{"id": "long_0", "messa')
    assert read_done(out) == {"geo_0", "py_0"}
    stats = regenerate(convs, generator, out, **kw)
    assert stats["skipped_already_done"] == 2 and stats["heldout_copied"] == 1
    assert stats["dropped_prompt_too_long"] == 1 and stats["no_answer_copied"] == 0
    lines = out.read_text().splitlines()
    recs = {r["id"]: r for r in map(json.loads, lines)}
    assert len(lines) == len(recs) == 3  # long_0's prompt does not fit: dropped, nothing duplicated

    held = convs[3]
    assert recs[held["id"]]["messages"] == held["messages"]

    geo = recs["geo_0"]["messages"]
    tok_eos = set(generator.eos_ids())
    # each turn is the target's greedy continuation (transformers as the reference),
    # the second one conditioned on the regenerated first answer
    first = tok.apply_chat(geo[:2], add_generation_prompt=True)
    ref1 = _hf_greedy(smollm2_hf_model, first, MAX_NEW)
    assert ref1[-1] in tok_eos, "the short factual answer should end its turn within MAX_NEW tokens"
    assert geo[2]["content"] == tok.decode(ref1, skip_special_tokens=True)
    assert [m["role"] for m in geo] == ["system", "user", "assistant", "user", "assistant"]
    assert "ORIGINAL" not in geo[2]["content"] + geo[4]["content"]
    second = tok.apply_chat(geo[:4], add_generation_prompt=True)
    ref2 = _hf_greedy(smollm2_hf_model, second, MAX_NEW)
    assert geo[4]["content"] == tok.decode(ref2, skip_special_tokens=True)
    assert recs["geo_0"]["regenerated_turns"] == 2
    assert recs["geo_0"]["truncated"] == (ref2[-1] not in tok_eos)

    # the file is training data: read back, rendered with response-only loss masks
    back = read_conversations(str(out), None)
    assert {c["id"] for c in back} == set(recs)
    ex = data.tokenize_conversations([c for c in back if c["id"] == "py_0"], tok.hf, max_length=256)[0]
    resp = np.asarray(ex["input_ids"])[np.asarray(ex["loss_mask"]) == 1]
    assert tok.decode(resp.tolist()).startswith(recs["py_0"]["messages"][1]["content"])


def test_regenerate_rejects_bad_arguments(generator, tmp_path):
    with pytest.raises(ValueError, match="max_turns"):
        regenerate(CONVS, generator, tmp_path / "x.jsonl", max_turns=0)


def test_later_turns_are_one_exchange_each_and_skip_held_out_conversations():
    held = _heldout_conv()
    held["messages"] += [{"role": "user", "content": "More?"}, {"role": "assistant", "content": "HELD 2"}]
    long = {"id": "chat_0", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "A"}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "B1"}, {"role": "user", "content": "B2"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "C"}, {"role": "assistant", "content": "c"},
        {"role": "assistant", "content": "an answer to nothing"},
        {"role": "user", "content": "D, never answered"}]}
    out = later_turns([CONVS[1], held, long])
    system = [{"role": "system", "content": "Be brief."}]
    assert out == [
        {"id": "chat_0#u1", "messages": system + [{"role": "user", "content": "B1"}, {"role": "user", "content": "B2"},
                                                  {"role": "assistant", "content": "b"}]},
        {"id": "chat_0#u2", "messages": system + [{"role": "user", "content": "C"},
                                                  {"role": "assistant", "content": "c"}]}]
