"""benchmarks/learning_curve.py: the point a training run appends, its schema, the committed held-out set.

A tiny random target with SmolLM2's vocabulary and tokenizer (hidden 32, 4 layers) trains a drafter for
two steps with ``learning_curve: true``; the point it appends is checked against the training run's own
numbers and against the teacher-forced tool and the engine run separately (the references).
"""

from __future__ import annotations

import copy
import json

import jax
import pytest

from eagle_jax.benchmarks import learning_curve as lc
from eagle_jax.benchmarks import teacher_forced
from eagle_jax.config import TargetConfig
from eagle_jax.models import drafter, target


def _conv(i):
    return {"id": f"c{i}_0", "messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
                                          {"role": "assistant", "content": f"{i} + {i} is {2 * i}. " * 3}]}


@pytest.fixture(scope="module")
def tiny(smollm2_target):
    tok = smollm2_target.tokenizer
    tcfg = TargetConfig(vocab_size=smollm2_target.cfg.vocab_size, hidden_size=32, intermediate_size=64,
                        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=1024,
                        eos_token_ids=smollm2_target.cfg.eos_token_ids, name_or_path="tiny-smollm2-vocab")
    return tcfg, target.init_params(tcfg, jax.random.PRNGKey(0)), tok


@pytest.fixture(scope="module")
def heldout_path(tmp_path_factory):
    records = ([{"set": "about", "sizes": {"answers": 2}}] + [{"set": "answers", **_conv(i)} for i in (1, 2)]
               + [{"set": "humaneval", "id": "HumanEval/0", "text": "def add(a, b):\n    return"},
                  {"set": "sharegpt", "id": "s1_0", "text": "Name a colour."}])
    path = lc.write_heldout_set(records, tmp_path_factory.mktemp("heldout") / "h.jsonl.gz")
    with pytest.raises(FileExistsError, match="fixed"):
        lc.write_heldout_set(records, path)
    return path


def test_committed_heldout_set_is_fixed():
    h = lc.read_heldout_set()
    assert [len(h[k]) for k in ("answers", "humaneval", "sharegpt")] == [24, 6, 6]
    assert [p["id"] for p in h["humaneval"]] == [f"HumanEval/{i}" for i in range(6)]
    assert all(c["messages"][-1]["role"] == "assistant" for c in h["answers"])
    assert h["about"]["sizes"] == lc.SET_SIZES and h["about"]["target_dtype"] == "float32"


def test_trainer_appends_its_point(tiny, heldout_path, tmp_path, monkeypatch):
    from eagle_jax.convert.drafter_formats import load_drafter
    from eagle_jax.generate import Generator
    from eagle_jax.train import data
    from eagle_jax.train import vocab as V
    from eagle_jax.train.config import TrainConfig
    from eagle_jax.train.trainer import Trainer

    tcfg, tparams, tok = tiny
    curve = tmp_path / "curve.jsonl"
    monkeypatch.setattr(lc, "HELDOUT_SET", str(heldout_path))
    monkeypatch.setattr(lc, "CURVE_FILE", str(curve))
    examples = data.tokenize_conversations([_conv(i) for i in range(8)], tok.hf, 64)
    d2t, _ = V.build_draft_vocab(V.token_frequencies(examples, tcfg.vocab_size), 256, tcfg.vocab_size)
    vocab = drafter.DraftVocab.from_target_ids(V.draft_to_target_ids(d2t), tcfg.vocab_size)
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), steps=2, batch_size=4, seq_len=64, draft_vocab_size=256,
                      aux_layer_ids=[1, 2, 3], warmup_steps=1, progress=False, eval_prompts=0,
                      eval_at_start=False, export_dtype="float32", learning_curve=True, data="tiny.jsonl")
    summary = Trainer(cfg, tcfg, tparams, examples, vocab, tokenizer=tok).run()
    (point,) = lc.read_curve(curve)
    assert point == summary["learning_curve"]
    tr = point["training"]
    assert tr["token_positions"] == summary["token_positions"] == 2 * 4 * 64 and tr["steps"] == 2
    assert tr["settings"]["lr"] == cfg.lr and tr["settings"]["ttt_length"] == 3 and tr["data"][0]["examples"] == 8
    assert point["label"] == "run" and point["variant"] == "eagle3"
    assert point["heldout_set"]["answers"] == ["c1_0", "c2_0"] and point["heldout_set"]["sharegpt"] == ["s1_0"]

    # references: the teacher-forced tool and the engine, run here on the exported drafter
    bundle = load_drafter(tmp_path / "run" / "drafter", tcfg)
    h = lc.read_heldout_set(heldout_path)
    want = teacher_forced.step_accuracy(tcfg, tparams, tok, *bundle, h["answers"], steps=3, seq_len=448)
    assert point["teacher_forced"] == want
    for name, spec in lc.ENGINES.items():
        gen = Generator(tcfg, tparams, tok, drafter=bundle, spec=spec)
        steps = accepted = 0
        for s in ("humaneval", "sharegpt"):
            st = gen.generate([h[s][0]["text"]], max_new_tokens=lc.MAX_NEW_TOKENS).stats
            got = point["tau"][name][s]
            assert (got["verify_steps"], got["accepted"]) == (st["num_verify_steps"], st["accepted_tokens"])
            steps, accepted = steps + st["num_verify_steps"], accepted + st["accepted_tokens"]
        assert point["tau"][name]["all"]["tau"] == pytest.approx(1 + accepted / steps)
        assert point["setting"]["engines"][name]["method"] == spec.method

    # schema: each broken field is named
    for path, value, msg in ((("variant",), "eagle4", "variant"),
                             (("teacher_forced", "strict"), [1.5], "teacher_forced.strict"),
                             (("tau", "chain-k4", "all", "tau"), 0.5, "tau.chain-k4.all"),
                             (("training", "token_positions"), "many", "training.token_positions")):
        bad = copy.deepcopy(point)
        node = bad
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        with pytest.raises(ValueError, match=msg):
            lc.validate_point(bad)
    tree = next(n for n in lc.ENGINES if n.startswith("tree-"))
    bad = copy.deepcopy(point)
    del bad["tau"][tree]
    with pytest.raises(ValueError, match=f"tau.{tree}"):
        lc.append_point(bad, curve)
    # chain k=5 came later: a point without it is whole when its setting does not list it
    old = copy.deepcopy(point)
    del old["tau"]["chain-k5"], old["setting"]["engines"]["chain-k5"]
    assert lc.validate_point(old) is old
    del bad["setting"]["engines"][tree]
    with pytest.raises(ValueError, match="setting.engines must list"):
        lc.validate_point(bad)
    bad = copy.deepcopy(point)
    del bad["tau"]["chain-k5"]
    with pytest.raises(ValueError, match="tau.chain-k5"):
        lc.validate_point(bad)
    curve.write_text(curve.read_text() + json.dumps(dict(point, schema="1")) + "\n")
    with pytest.raises(ValueError, match="curve.jsonl:2: .*'schema'"):
        lc.read_curve(curve)


def test_measure_refuses_a_bf16_target(tiny, heldout_path):
    from eagle_jax.config import ConfigError

    tcfg, tparams, tok = tiny
    bf16 = jax.tree.map(lambda x: x.astype("bfloat16"), tparams)
    with pytest.raises(ConfigError, match="float32"):  # checked before the drafter is used
        lc.measure(tcfg, bf16, tok, (None, None, None), lc.read_heldout_set(heldout_path))
