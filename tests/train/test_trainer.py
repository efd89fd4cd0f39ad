"""Trainer: features, resume, SIGKILL recovery, config handling, a small end-to-end run.

Everything runs on a tiny random target (4 layers, hidden 64, vocab 256) whose
lm_head is scaled up so that its distributions are peaked; the training data
are its own greedy continuations of random prompts (so the drafter has
something learnable). This file is also the child process of the SIGKILL
test: ``python test_trainer.py child OUT_DIR`` trains slowly until killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.config import ConfigError, TargetConfig
from eagle_jax.kernels import resolve_impl
from eagle_jax.models import drafter, target

TCFG = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=1024, name_or_path="tiny-random")


def tiny_target():
    params = target.init_params(TCFG, jax.random.PRNGKey(0))
    # A large embedding dominates the residual stream: the next token depends mostly on the
    # current one (close to a random bigram model), so greedy text walks a fixed random graph
    # that held-out prompts share with the training data. lm_head x40: logits std ~ 6 (peaked).
    params["embed"] = params["embed"] * 10.0
    params["lm_head"] = params["lm_head"] * 40.0
    return params


def greedy_examples(tparams, n, seed, prompt_len=4, new=60):
    """Examples {input_ids, loss_mask}: random prompt (mask 0) + the target's greedy continuation (mask 1)."""
    from eagle_jax.generate import Generator

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, TCFG.vocab_size, prompt_len).tolist() for _ in range(n)]
    res = Generator(TCFG, tparams, None).generate(prompts, max_new_tokens=new)
    out = []
    for i, (p, g) in enumerate(zip(prompts, res.token_ids)):
        ids = np.asarray(p + g, np.int32)
        lm = np.r_[np.zeros(len(p)), np.ones(len(g))].astype(np.int32)
        out.append({"id": f"{seed}-{i}", "input_ids": ids, "loss_mask": lm})
    return out, prompts


def make_vocab(examples, size=128):
    from eagle_jax.train import vocab as V

    d2t, _ = V.build_draft_vocab(V.token_frequencies(examples, TCFG.vocab_size), size, TCFG.vocab_size)
    return drafter.DraftVocab.from_target_ids(V.draft_to_target_ids(d2t), TCFG.vocab_size)


def small_cfg(out, **kw):
    from eagle_jax.train.config import TrainConfig

    base = dict(output_dir=str(out), steps=10, batch_size=4, seq_len=64, draft_vocab_size=128,
                ttt_length=3, lr=3e-3, warmup_steps=3, save_every=2, max_to_keep=3, progress=False,
                eval_prompts=0, eval_at_start=False, export=False, seed=0, aux_layer_ids=[1, 2, 3])
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def setup():
    tparams = tiny_target()
    train, _ = greedy_examples(tparams, 32, seed=1)
    return tparams, train, make_vocab(train)


def _params(trainer):
    return jax.tree.map(np.asarray, trainer.state["params"])


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    """An uninterrupted 10-step run."""
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    tr = Trainer(small_cfg(tmp_path_factory.mktemp("ref")), TCFG, tparams, train, vocab)
    tr.run()
    return _params(tr), tr.log_path


# ----------------------------------------------------------------------------- features

# chunks overlapping at the end of a range, an odd vocabulary, one chunk; as a tied embedding [V, H] (axis 0)
# or an lm_head [H, V] (axis 1); in 4 or 8 ranges as a mesh's model axis splits it (here on one device)
@pytest.mark.parametrize("v, chunk, shards, axis", [(256, 48, 1, 1), (257, 64, 1, 0), (256, 8192, 1, 1),
                                                    (256, 48, 4, 0), (264, 100, 8, 1)])
def test_nondraft_max_equals_the_dense_max(v, chunk, shards, axis):
    from eagle_jax.train import features as F

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
    normed, w = jax.random.normal(k1, (2, 5, 16)), jax.random.normal(k2, (16, v))
    t2d = jax.random.bernoulli(k3, 0.3, (v,))
    want = jnp.max(jnp.where(t2d, -jnp.inf, jnp.dot(normed, w, precision="highest")), -1)
    got = F._nondraft_max(normed, w if axis else w.T, t2d, chunk, shards, axis)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    t2d = t2d.at[: v // shards].set(True)  # the first range all in the draft vocab: the max comes from the others
    want = jnp.max(jnp.where(t2d, -jnp.inf, jnp.dot(normed, w, precision="highest")), -1)
    np.testing.assert_allclose(F._nondraft_max(normed, w if axis else w.T, t2d, chunk, shards, axis), want,
                               rtol=1e-5, atol=1e-5)


def test_features_match_full_logits(setup):
    from eagle_jax.train import features as F

    tparams, train, vocab = setup
    fn = F.make_feature_fn(TCFG, (1, 2, 3), argmax_mode="chunked", vocab_chunk=48)  # 8 chunks of 32
    tokens = jnp.asarray(np.stack([train[i]["input_ids"][:32] for i in range(3)]))
    feats = fn(tparams, tokens, F.draft_head(tparams, TCFG, vocab.target_ids), vocab.t2d)
    pos = jnp.broadcast_to(jnp.arange(32), tokens.shape)
    model = target.Target(TCFG, tparams)
    hidden, _, aux = model(tokens, pos, target.create_cache(TCFG, 3, 32),
                                    aux_layers=(1, 2, 3))
    full = model.logits(hidden)
    np.testing.assert_allclose(np.asarray(feats.aux), np.asarray(aux), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(feats.logits), np.asarray(full[..., vocab.target_ids]),
                               rtol=1e-4, atol=1e-4)
    want = np.asarray(vocab.t2d)[np.asarray(jnp.argmax(full, -1))]
    np.testing.assert_array_equal(np.asarray(feats.in_vocab), want)
    # a vocab that misses the greedy tokens: the flag must turn off there
    ids = np.setdiff1d(np.arange(256), np.asarray(jnp.argmax(full, -1))[0, :8])[:100]
    v2 = drafter.DraftVocab.from_target_ids(ids, 256)
    f2 = fn(tparams, tokens, F.draft_head(tparams, TCFG, v2.target_ids), v2.t2d)
    assert not np.asarray(f2.in_vocab)[0, :8].any()
    full_mode = F.make_feature_fn(TCFG, (1, 2, 3), argmax_mode="full")(tparams, tokens, F.draft_head(tparams, TCFG, v2.target_ids),
                                                                          v2.t2d)
    np.testing.assert_array_equal(np.asarray(full_mode.in_vocab), np.asarray(f2.in_vocab))


def test_feature_cache_round_trip(setup, tmp_path):
    from eagle_jax.train import features as F
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    tr = Trainer(small_cfg(tmp_path, feature_cache=True), TCFG, tparams, train, vocab)
    from eagle_jax.train.step import iter_batches

    batch = next(iter_batches(train, 4, 64))
    online = tr.batch_features(batch)  # computes and stores
    tr.feature_cache.flush()
    assert tr.feature_cache.has_all(batch["example_indices"])
    cached = tr.batch_features(batch)  # served from disk (bfloat16)
    n = batch["lengths"]
    for r in range(4):
        np.testing.assert_allclose(np.asarray(cached["aux"][r, :n[r]]), np.asarray(online["aux"][r, :n[r]]),
                                   rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(np.asarray(cached["target_logits"][r, :n[r]]),
                                   np.asarray(online["target_logits"][r, :n[r]]), rtol=0.05, atol=0.3)
        np.testing.assert_array_equal(np.asarray(cached["in_vocab"][r, :n[r]]),
                                      np.asarray(online["in_vocab"][r, :n[r]]))
    assert tr.feature_cache.size_bytes() > 0
    # a new cache object reads the index back
    again = F.FeatureCache(tr.feature_cache.dir, tr.feature_cache.meta)
    assert again.has_all(batch["example_indices"])


def test_iter_batches_matches_data_batches(setup):
    from eagle_jax.train import data
    from eagle_jax.train.step import iter_batches

    _, train, _ = setup
    ref = list(data.batches(train, 4, 64, seed=3, epochs=2))
    it = iter_batches(train, 4, 64, seed=3, start=5)
    for want in ref[5:]:
        got = next(it)
        assert got["index"] == want["index"]
        np.testing.assert_array_equal(got["input_ids"], want["input_ids"])
        np.testing.assert_array_equal(got["loss_mask"], want["loss_mask"])


# ----------------------------------------------------------------------------- init

def test_init_copies_target_head_and_norm(setup):
    from eagle_jax.train.initialize import build_drafter_config, init_drafter_params

    tparams, _, vocab = setup
    dcfg = build_drafter_config(TCFG, small_cfg("/tmp/unused", variant="eagle3.1"))
    assert dcfg.fc_norm and dcfg.norm_output and dcfg.aux_layer_ids == (1, 2, 3)
    p = init_drafter_params(dcfg, TCFG, tparams, vocab, jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(p["lm_head"]), np.asarray(tparams["lm_head"][:, vocab.target_ids]))
    np.testing.assert_array_equal(np.asarray(p["norm"]), np.asarray(tparams["final_norm"]))
    assert "embed" not in p
    np.testing.assert_array_equal(np.asarray(p["fc_norm"]), 1.0)


# ----------------------------------------------------------------------------- resume

def test_resume_reproduces_uninterrupted_run(setup, reference, tmp_path):
    from eagle_jax.train.card import read_log
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    ref_params, ref_log = reference
    cfg = small_cfg(tmp_path)
    first = Trainer(cfg, TCFG, tparams, train, vocab)
    s = first.run(stop_after=5)  # checkpoints at 2 and 4; step 5 is lost
    assert s["step"] == 5
    second = Trainer(cfg, TCFG, tparams, train, vocab)  # a fresh trainer, as after a restart
    second.run()
    got = _params(second)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, ref_params)
    want = {r["step"]: r["loss"] for r in read_log(ref_log) if r["type"] == "train"}
    have = {r["step"]: r["loss"] for r in read_log(second.log_path) if r["type"] == "train"}
    for k in range(5, 11):  # step 5 ran twice (once before the "crash"), then 6..10
        np.testing.assert_allclose(have[k], want[k], rtol=1e-6)
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [6, 8, 10]  # max_to_keep = 3


def test_resume_with_changed_settings_is_logged_and_carded(setup, tmp_path):
    from eagle_jax.train.card import read_log
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    Trainer(small_cfg(tmp_path, steps=4, export=False), TCFG, tparams, train, vocab).run()
    Trainer(small_cfg(tmp_path, steps=6, export=False), TCFG, tparams, train, vocab).run()
    resumes = [r for r in read_log(tmp_path / "train_log.jsonl") if r["type"] == "resume"]
    assert resumes == [{"type": "resume", "step": 4, "cursor": 4, "changed": {"steps": [4, 6]}}]
    assert "- resumed at step 4, changed: steps 4 -> 6" in (tmp_path / "model_card.md").read_text()
    # the target pass's dtype is a setting of the run like the others
    Trainer(small_cfg(tmp_path, steps=7, export=False, target_dtype="bfloat16"), TCFG, tparams, train, vocab).run()
    resumes = [r for r in read_log(tmp_path / "train_log.jsonl") if r["type"] == "resume"]
    assert resumes[-1]["changed"] == {"steps": [6, 7], "target_dtype": [None, "bfloat16"]}


def test_no_resume_refuses_existing_checkpoints(setup, tmp_path):
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    Trainer(small_cfg(tmp_path, steps=2), TCFG, tparams, train, vocab).run()
    with pytest.raises(FileExistsError):
        Trainer(small_cfg(tmp_path, steps=4, resume=False), TCFG, tparams, train, vocab).run()


def _child(out_dir: str) -> None:
    """Train the reference config slowly (0.3 s per step) until killed."""
    from eagle_jax.train.trainer import Trainer

    tparams = tiny_target()
    train, _ = greedy_examples(tparams, 32, seed=1)
    tr = Trainer(small_cfg(out_dir), TCFG, tparams, train, make_vocab(train))
    step = tr.train_step

    def slow(*a):
        out = step(*a)
        jax.block_until_ready(out)
        time.sleep(0.3)
        return out

    tr.train_step = slow
    tr.run()


def test_sigkill_resumes_from_last_checkpoint(setup, reference, tmp_path):
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    ckpt = tmp_path / "checkpoints"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, __file__, "child", str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 150
        while time.time() < deadline:
            done = [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()] if ckpt.is_dir() else []
            if any(s >= 4 for s in done):
                break
            if proc.poll() is not None:
                pytest.fail("child exited early:\n" + proc.stdout.read().decode()[-3000:])
            time.sleep(0.05)
        else:
            pytest.fail("child made no checkpoint >= 4 in time")
        time.sleep(0.35)  # land somewhere inside a later step
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    tr = Trainer(small_cfg(tmp_path), TCFG, tparams, train, vocab)
    latest = tr.manager().latest_step()
    assert latest is not None and 4 <= latest < 10
    tr.run()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), _params(tr), reference[0])


# ----------------------------------------------------------------------------- config / CLI

def test_config_errors_and_overrides(tmp_path):
    import argparse

    from eagle_jax.train import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 10\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        cli.load_config(parser.parse_args(["--config", str(bad)]))
    with pytest.raises(ConfigError, match="ttt_lenght"):
        cli.load_config(parser.parse_args(["--set", "ttt_lenght=3"]))
    good = tmp_path / "good.json"
    good.write_text('{"steps": 10, "variant": "eagle3", "lr": 0.001}')
    cfg = cli.load_config(parser.parse_args(["--config", str(good), "--steps", "7", "--variant", "eagle3.1",
                                             "--no-resume", "--set", "bucket_lengths=[32, 64]",
                                             "--seq-len", "64"]))
    assert (cfg.steps, cfg.variant, cfg.lr, cfg.resume, cfg.bucket_lengths) == (7, "eagle3.1", 0.001, False, [32, 64])
    with pytest.raises(ConfigError, match="variant"):
        cli.load_config(parser.parse_args(["--set", "variant=eagle4"]))
    assert cli.load_config(parser.parse_args(["--labels", "hard"])).labels == "hard"
    with pytest.raises(ConfigError, match="labels must be one of"):
        cli.load_config(parser.parse_args(["--set", "labels=argmax"]))
    for bad_value in ("0", "-8", "1.5"):  # 0 must not fall back to the target's width
        with pytest.raises(ConfigError, match="intermediate_size must be a positive integer or null"):
            cli.load_config(parser.parse_args(["--set", f"intermediate_size={bad_value}"]))
    assert cli.load_config(parser.parse_args(["--set", "intermediate_size=3072"])).intermediate_size == 3072
    # YAML 1.1 reads 2e-4 (no decimal point) as a string: it must still be the number 2e-4
    assert cli.load_config(parser.parse_args(["--set", "lr=2e-4"])).lr == 2e-4
    for bad_value in ("fast", ".nan", "inf"):
        with pytest.raises(ConfigError, match="lr must be a finite number"):
            cli.load_config(parser.parse_args(["--set", f"lr={bad_value}"]))
    configs = sorted((Path(__file__).resolve().parents[2] / "train" / "configs").glob("*.yaml"))
    assert len(configs) >= 4
    for path in configs:  # every shipped config parses
        cfg = cli.load_config(parser.parse_args(["--config", str(path)]))
        eagle3 = path.stem in ("smollm2-eagle3", "smollm2-eagle3-stage2", "smollm2-matched")  # matched: 3 by default
        assert cfg.variant == ("eagle3" if eagle3 else "eagle3.1"), path.name


# ----------------------------------------------------------------------------- end to end

def test_training_improves_acceptance(setup, tmp_path):
    """200 steps: loss falls, and tau through the real engine beats the untrained drafter."""
    from eagle_jax.convert.drafter_formats import load_drafter
    from eagle_jax.train.card import read_log
    from eagle_jax.train.trainer import Trainer

    tparams, _, _ = setup
    train, _ = greedy_examples(tparams, 96, seed=2)
    _, held = greedy_examples(tparams, 6, seed=99)
    vocab = make_vocab(train)
    cfg = small_cfg(tmp_path, steps=200, batch_size=8, lr=2e-3, warmup_steps=20, save_every=200,
                    eval_every=0, eval_at_start=True, eval_prompts=6, eval_max_new_tokens=40,
                    eval_k=4, export=True, export_dtype="float32")
    tr = Trainer(cfg, TCFG, tparams, train, vocab, eval_prompts=held)
    s = tr.run()
    recs = read_log(tr.log_path)
    losses = [r["loss"] for r in recs if r["type"] == "train"]
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:10]), (losses[:10], losses[-20:])
    tau0, tau1 = s["start_eval"]["tau"], s["eval"]["tau"]
    assert tau1 > tau0 + 0.5, (tau0, tau1)
    assert s["eval"]["per_position"][0] > 0.5
    # outputs
    for name in ("training_curves.png", "model_card.md", "train_log.jsonl", "drafter/config.json",
                 "drafter/model.safetensors", "drafter/model_card.md"):
        assert (tmp_path / name).is_file(), name
    card = (tmp_path / "model_card.md").read_text()
    assert "tau" in card and "cores" in card
    dcfg, dparams, dvocab = load_drafter(tmp_path / "drafter", TCFG)
    assert dcfg.draft_vocab_size == 128 and not dcfg.fc_norm
    np.testing.assert_array_equal(np.asarray(dvocab.target_ids), np.asarray(vocab.target_ids))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6),
                 dparams, _params(tr))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "child":
    _child(sys.argv[2])


def test_read_conversations_concatenates_sources(tmp_path):
    from eagle_jax.train import datastore

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    a.write_text("".join(json.dumps({"id": f"a{i}", "messages": msgs}) + "\n" for i in range(3)))
    b.write_text(json.dumps({"id": "b0", "conversations": [{"from": "human", "value": "q"},
                                                          {"from": "gpt", "value": "r"}]}) + "\n")
    got = datastore.read_conversations(f"{a}, {b},{a}", limit=2)
    assert [c["id"] for c in got] == ["a0", "a1", "b0", "a0", "a1"]
    assert got[2]["messages"][1] == {"role": "assistant", "content": "r"}
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        datastore.read_conversations(f"{a},{tmp_path / 'missing.jsonl'}", None)


def test_init_from_starts_at_the_exported_drafter(setup, tmp_path):
    """init_from: a fresh run starts from an exported drafter's weights and vocab; a mismatch is named."""
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    first = Trainer(small_cfg(tmp_path / "a", steps=4, export=True, export_dtype="float32"),
                    TCFG, tparams, train, vocab)
    first.run()
    exported = tmp_path / "a" / "drafter"
    second = Trainer(small_cfg(tmp_path / "b", steps=2, init_from=str(exported)), TCFG, tparams, train, vocab)
    start = jax.tree.map(np.asarray, second.init_state()["params"])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), start, _params(first))
    second.run()
    assert "init: the drafter at" in (tmp_path / "b" / "model_card.md").read_text()

    with pytest.raises(ConfigError, match="fc_norm False"):
        Trainer(small_cfg(tmp_path / "c", variant="eagle3.1", init_from=str(exported)),
                TCFG, tparams, train, vocab).init_state()
    other = make_vocab(train[::-1], size=64)
    with pytest.raises(ConfigError, match="draft_vocab_size 128"):
        Trainer(small_cfg(tmp_path / "d", draft_vocab_size=64, init_from=str(exported)),
                TCFG, tparams, train, other).init_state()


def test_init_from_a_smaller_vocabulary_widens_the_head(setup, tmp_path):
    """A larger draft_vocab_size widens the starting drafter: its head columns kept, the added ids' the target's
    mapped by the least-squares fit of the kept ones, every other weight as exported; the run trains and
    exports the wider drafter."""
    from eagle_jax.convert.drafter_formats import load_drafter
    from eagle_jax.train import vocab as V
    from eagle_jax.train.trainer import Trainer

    tparams, train, _ = setup
    small = make_vocab(train, size=64)
    first = Trainer(small_cfg(tmp_path / "a", steps=3, draft_vocab_size=64, export=True, export_dtype="float32"),
                    TCFG, tparams, train, small)
    first.run()
    d2t, _ = V.widen_draft_vocab(small.d2t, V.token_frequencies(train, TCFG.vocab_size), 128, TCFG.vocab_size)
    wide = drafter.DraftVocab.from_target_ids(V.draft_to_target_ids(d2t), TCFG.vocab_size)
    cfg = small_cfg(tmp_path / "b", steps=2, export=True, export_dtype="float32",
                    init_from=str(tmp_path / "a" / "drafter"))
    second = Trainer(cfg, TCFG, tparams, train, wide)
    start = jax.tree.map(np.asarray, second.init_state()["params"])
    before = _params(first)
    old_ids, new_ids = np.asarray(small.target_ids), np.asarray(wide.target_ids)
    head_t = np.asarray(target.Target(TCFG, tparams).lm_head_weight(), np.float64)  # [H, V]
    # reference map: solve the normal equations A (W_old W_old^T) = D W_old^T (H = 64 < 64 old ids: full rank)
    w_old = head_t[:, old_ids]
    a = np.linalg.solve(w_old @ w_old.T, w_old @ before["lm_head"].astype(np.float64).T).T
    for j, t in enumerate(new_ids):
        if t in set(old_ids):
            np.testing.assert_array_equal(start["lm_head"][:, j], before["lm_head"][:, list(old_ids).index(t)])
        else:
            np.testing.assert_allclose(start["lm_head"][:, j], a @ head_t[:, t], rtol=1e-4, atol=1e-5)
    del start["lm_head"], before["lm_head"]
    jax.tree.map(np.testing.assert_array_equal, start, before)
    second.run()
    lcfg, _, vocab = load_drafter(tmp_path / "b" / "drafter", TCFG)
    assert lcfg.draft_vocab_size == 128 and np.array_equal(np.asarray(vocab.target_ids), new_ids)
    assert "vocabulary widened to 128" in (tmp_path / "b" / "model_card.md").read_text()
    # a vocabulary that drops one of the drafter's ids cannot continue it
    drops = np.setdiff1d(np.arange(TCFG.vocab_size), old_ids[:1])[:128]
    with pytest.raises(ConfigError, match="does not hold all 64"):
        Trainer(cfg.replace(output_dir=str(tmp_path / "c")), TCFG, tparams, train,
                drafter.DraftVocab.from_target_ids(drops, TCFG.vocab_size)).init_state()


def test_init_from_a_narrower_mlp_widens_it_without_changing_the_function(setup, tmp_path):
    """A larger intermediate_size widens the starting drafter's MLP: its gate, up and down weights kept, the
    new units' down rows zero, so the widened drafter's outputs equal the narrow one's (checked through
    Drafter.step on random inputs); the run trains the new units and exports the wider drafter; narrowing
    is refused."""
    from eagle_jax.convert.drafter_formats import load_drafter
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    first = Trainer(small_cfg(tmp_path / "a", steps=3, export=True, export_dtype="float32"), TCFG, tparams, train,
                    vocab)
    first.run()
    cfg = small_cfg(tmp_path / "b", steps=2, export=True, export_dtype="float32", intermediate_size=200,
                    init_from=str(tmp_path / "a" / "drafter"))
    second = Trainer(cfg, TCFG, tparams, train, vocab)
    start = jax.tree.map(np.asarray, second.init_state()["params"])
    before = _params(first)
    f, h = TCFG.intermediate_size, TCFG.hidden_size
    gate_up, down = start["layer"].pop("w_gate_up"), start["layer"].pop("w_down")
    old_gate_up, old_down = before["layer"].pop("w_gate_up"), before["layer"].pop("w_down")
    assert gate_up.shape == (h, 400) and down.shape == (200, h)
    np.testing.assert_array_equal(gate_up[:, :f], old_gate_up[:, :f])  # gate
    np.testing.assert_array_equal(gate_up[:, 200:200 + f], old_gate_up[:, f:])  # up
    assert np.abs(gate_up[:, f:200]).min() > 0 and np.abs(gate_up[:, 200 + f:]).min() > 0  # new units drawn
    np.testing.assert_array_equal(down[:f], old_down)
    np.testing.assert_array_equal(down[f:], 0)
    jax.tree.map(np.testing.assert_array_equal, start, before)  # every other weight as exported

    def outputs(dcfg, params):
        rng = np.random.default_rng(3)
        tokens = jnp.asarray(rng.integers(0, TCFG.vocab_size, (2, 5)), jnp.int32)
        hidden = jnp.asarray(rng.normal(size=(2, 5, h)), jnp.float32)
        positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
        cache = drafter.create_cache(dcfg, 2, 8)
        logits, feedback, _ = drafter.Drafter(dcfg, params).step(tokens, hidden, positions, cache,
                                                                 embed=tparams["embed"], impl="xla")
        return np.asarray(logits), np.asarray(feedback)

    narrow = outputs(first.dcfg, first.state["params"])
    wide = outputs(second.dcfg, second.init_state()["params"])
    for a, b in zip(narrow, wide):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    second.run()
    after = _params(second)
    assert np.abs(after["layer"]["w_down"][f:]).max() > 0  # the new units trained
    lcfg, _, _ = load_drafter(tmp_path / "b" / "drafter", TCFG)
    assert lcfg.intermediate_size == 200
    assert "MLP widened from 128 to 200 units" in (tmp_path / "b" / "model_card.md").read_text()
    narrower = small_cfg(tmp_path / "c", intermediate_size=100, init_from=str(tmp_path / "a" / "drafter"))
    with pytest.raises(ConfigError, match="an MLP can be widened, not narrowed"):
        Trainer(narrower, TCFG, tparams, train, vocab).init_state()


@pytest.mark.skipif(resolve_impl("auto") != "native", reason="the native CPU kernels do not load here")
def test_feature_pass_on_packed_weights_matches_the_xla_pass(setup, tmp_path):
    """Where the native kernels load, the trainer's feature pass runs the decoder layers on packed
    weights: the features of the plain XLA pass up to f32 summation order."""
    from eagle_jax.train import features as F
    from eagle_jax.train.step import iter_batches
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    tr = Trainer(small_cfg(tmp_path, steps=2), TCFG, tparams, train, vocab)
    batch = next(iter_batches(train, 4, 64))
    got = tr.batch_features(batch)
    compiled = tr.feature_fn.lower(tr.feature_params, jnp.asarray(batch["input_ids"]), tr.draft_head, tr.t2d,
                                   tr.forward_params).compile().as_text()
    assert 'custom_call_target="eagle_matmul"' in compiled
    want = F.make_feature_fn(TCFG, (1, 2, 3), impl="xla")(tparams, jnp.asarray(batch["input_ids"]),
                                                          F.draft_head(tparams, TCFG, vocab.target_ids), vocab.t2d)
    np.testing.assert_allclose(np.asarray(got["aux"]), np.asarray(want.aux), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got["target_logits"]), np.asarray(want.logits), rtol=1e-4, atol=1e-4)
    assert np.mean(np.asarray(got["in_vocab"]) == np.asarray(want.in_vocab)) >= 0.99


@pytest.mark.skipif(resolve_impl("auto") != "native", reason="the native CPU kernels do not load here")
def test_bf16_drafter_gradient_equals_autodiff(setup, tmp_path):
    """dtype=bfloat16: the drafter's dots differentiate row-major on native transposes
    (kernels.fused_norm_matmul._dot); the gradient of the TTT loss is autodiff's through
    jnp.dot up to rounding the dots' cotangents to bf16, and the compiled step holds the
    transposes."""
    from eagle_jax.train import ttt
    from eagle_jax.train.step import iter_batches
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    tr = Trainer(small_cfg(tmp_path, steps=2, dtype="bfloat16"), TCFG, tparams, train, vocab)
    params = tr.init_state()["params"]
    b = tr.batch_features(next(iter_batches(train, 4, 64)))
    bf16 = jnp.bfloat16

    def loss(params, impl):
        p = jax.tree.map(lambda x: x.astype(bf16), params)
        logits = ttt.unroll(p, tr.dcfg, jnp.asarray(tparams["embed"], bf16), b["aux"], b["input_ids"],
                            b["lengths"], 3, impl=impl)
        return ttt.ttt_loss(logits, b["target_logits"], b["in_vocab"], b["loss_mask"], impl=impl)[0]

    ours = jax.jit(jax.grad(partial(loss, impl="auto")))
    assert ours.lower(params).compile().as_text().count('custom_call_target="eagle_transpose"') >= 8
    got = ours(params)
    xla = jax.jit(jax.grad(partial(loss, impl="xla")))  # jnp.dot, differentiated by JAX
    assert "eagle_transpose" not in xla.lower(params).compile().as_text()
    want = xla(params)
    for name in ("fc", "lm_head"):
        g, w = np.asarray(got[name]), np.asarray(want[name])
        assert np.linalg.norm(g - w) <= 0.02 * np.linalg.norm(w), name
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        g, w = np.asarray(got["layer"][name]), np.asarray(want["layer"][name])
        assert np.linalg.norm(g - w) <= 0.02 * np.linalg.norm(w), name


def test_target_dtype_runs_the_target_pass_alone_in_bfloat16(setup, tmp_path):
    """target_dtype: the features are those of the bf16-cast target (an independent feature fn), handed to the
    float32 drafter as float32; the drafter's parameters and step stay float32."""
    from eagle_jax.train import features as F
    from eagle_jax.train.step import iter_batches
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    tr = Trainer(small_cfg(tmp_path / "a", steps=2, target_dtype="bfloat16"), TCFG, tparams, train, vocab)
    batch = next(iter_batches(train, 4, 64))
    got = tr.batch_features(batch)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tparams)
    packed = target.prepare_for_decoding(bf16, TCFG) if resolve_impl("auto") == "native" else None
    want = F.make_feature_fn(TCFG, (1, 2, 3))(bf16, jnp.asarray(batch["input_ids"]),
                                              F.draft_head(bf16, TCFG, vocab.target_ids), vocab.t2d, packed)
    assert got["aux"].dtype == jnp.float32 and want.aux.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got["aux"]), np.asarray(want.aux.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(got["target_logits"]), np.asarray(want.logits))
    np.testing.assert_array_equal(np.asarray(got["in_vocab"]), np.asarray(want.in_vocab))
    # and they are not the float32 features (else the setting did nothing)
    f32 = Trainer(small_cfg(tmp_path / "b", steps=2), TCFG, tparams, train, vocab).batch_features(batch)
    assert not np.array_equal(np.asarray(f32["target_logits"]), np.asarray(got["target_logits"]))
    tr.run()
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(tr.state["params"]))
    assert "(target pass bfloat16)" in (tmp_path / "a" / "model_card.md").read_text()
    with pytest.raises(ConfigError, match="target_dtype must be float32 or bfloat16"):
        small_cfg(tmp_path / "c", target_dtype="float16").validate()


def test_parallel_drafting_from_a_sequential_drafter(setup, tmp_path):
    """parallel_drafting (P-EAGLE) from a saved EAGLE 3.1 drafter: its weights plus a fresh
    mask_hidden, so step 0 (the first proposed token) is exactly the sequential drafter's; a few
    steps lower the loss on a fixed batch; the export is a speculators peagle checkpoint."""
    from eagle_jax.convert.drafter_formats import load_drafter, save_drafter
    from eagle_jax.train import ttt
    from eagle_jax.train.initialize import build_drafter_config, init_drafter_params
    from eagle_jax.train.step import iter_batches
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    seq_cfg = build_drafter_config(TCFG, small_cfg(tmp_path / "a", variant="eagle3.1"))
    seq_params = init_drafter_params(seq_cfg, TCFG, tparams, vocab, jax.random.PRNGKey(7))
    save_drafter(tmp_path / "a" / "drafter", seq_cfg, seq_params, vocab)
    seq_params = jax.tree.map(np.asarray, seq_params)
    cfg = small_cfg(tmp_path / "b", steps=12, variant="eagle3.1", init_from=str(tmp_path / "a" / "drafter"),
                    parallel_drafting=True, mask_token_id=5, ttt_length=4, step_decay=1.0, lr=1e-2, export=True,
                    export_dtype="float32")
    tr = Trainer(cfg, TCFG, tparams, train, vocab)
    assert tr.dcfg.mask_token_id == 5 and tr.dcfg.speculative_tokens == 4
    start = jax.tree.map(np.asarray, tr.init_state()["params"])
    assert set(start) == set(seq_params) | {"mask_hidden"}
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b),
                 {k: v for k, v in start.items() if k != "mask_hidden"}, seq_params)

    feats = tr.batch_features(next(iter_batches(train, 4, 64, seed=99)))
    embed = jnp.asarray(tparams["embed"])

    @partial(jax.jit, static_argnums=0)
    def forward(dcfg, params):
        return ttt.unroll(params, dcfg, embed, feats["aux"], feats["input_ids"], feats["lengths"], 4, impl="xla")

    def loss(params):
        return float(jax.jit(lambda lg: ttt.ttt_loss(lg, feats["target_logits"], feats["in_vocab"],
                                                     feats["loss_mask"], step_decay=1.0)[0])(forward(tr.dcfg, params)))

    np.testing.assert_array_equal(np.asarray(forward(tr.dcfg, start)[0]),
                                  np.asarray(forward(seq_cfg, seq_params)[0]))
    before = loss(start)
    tr.run()
    after = loss(tr.state["params"])
    assert after < 0.9 * before, (before, after)

    cfg_out, params_out, _ = load_drafter(tmp_path / "b" / "drafter", TCFG)
    assert cfg_out.mask_token_id == 5 and cfg_out.speculative_tokens == 4
    np.testing.assert_array_equal(np.asarray(params_out["mask_hidden"]), _params(tr)["mask_hidden"])
    assert json.loads((tmp_path / "b" / "drafter" / "config.json").read_text())["speculators_model_type"] == "peagle"
