"""train/state.py: a committed training state, exported by one run and resumed on a fresh checkout.

The tiny random target of test_trainer.py. The reference for a resumed run is a hand-driven loop: the
state's drafter weights (read back from its safetensors file), a fresh optimiser, and the batches of
``data.batches`` from the state's cursor on.
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from eagle_jax.config import ConfigError
from eagle_jax.train import state as S
from test_trainer import TCFG, greedy_examples, make_vocab, small_cfg, tiny_target


@pytest.fixture(scope="module")
def setup():
    tparams = tiny_target()
    train, _ = greedy_examples(tparams, 32, seed=1)
    return tparams, train, make_vocab(train)


def _params(tr):
    return jax.tree.map(np.asarray, tr.state["params"])


def test_resume_from_a_committed_state_on_a_fresh_checkout(setup, tmp_path):
    from safetensors.numpy import load_file

    from eagle_jax.train import data
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    repo = tmp_path / "repo"
    first = Trainer(small_cfg(repo / "runs" / "a", steps=4, export=True, export_dtype="float32",
                              export_state=str(repo / "train" / "state" / "eagle3")), TCFG, tparams, train, vocab)
    first.run()
    # a fresh clone: only the committed state, moved elsewhere (the run's output dir is not there)
    clone = tmp_path / "clone"
    shutil.copytree(repo / "train", clone / "train")
    state_dir = clone / "train" / "state" / "eagle3"
    st = S.read_state(state_dir)
    assert (st["step"], st["token_positions"], st["cursor"]["next_batch"]) == (4, 4 * 4 * 64, 4)
    assert st["drafter"] == str((state_dir / "drafter").resolve()) and st["optimizer"] is None
    exported = load_file(str(state_dir / "drafter" / "model.safetensors"))
    assert np.array_equal(exported["fc.weight"].T, _params(first)["fc"])  # speculators layout [out, in]

    cfg = small_cfg(tmp_path / "b", steps=3, export=True, export_dtype="float32", resume_from=str(state_dir),
                    export_state=str(state_dir), warmup_steps=1)
    second = Trainer(cfg, TCFG, tparams, train, vocab)
    # reference: the state's weights, a fresh optimiser, batches 4, 5, 6 of the data order
    ref = Trainer(cfg.replace(resume_from=None, export_state=None, init_from=str(state_dir / "drafter"),
                              output_dir=str(tmp_path / "ref")), TCFG, tparams, train, vocab)
    state = ref.init_state()
    np.testing.assert_array_equal(np.asarray(state["params"]["fc"]), exported["fc.weight"].T)
    batches = data.batches(train, 4, 64, seed=0, start=0, epochs=None)
    want = [next(batches) for _ in range(7)][4:]
    embed = jax.numpy.asarray(tparams["embed"])
    for b in want:
        state, _ = ref.train_step(state, embed, ref.batch_features(b))
    s = second.run()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-7),
                 _params(second), state["params"])
    log = [json.loads(x) for x in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["type"] == "resume_from" and log[0]["start_batch"] == 4
    assert f"from the training state {state_dir}" in (tmp_path / "b" / "model_card.md").read_text()
    # the state now stands for both runs
    st2 = S.read_state(state_dir)
    assert s["token_positions"] == 3 * 4 * 64
    assert (st2["step"], st2["token_positions"], st2["cursor"]["next_batch"]) == (7, 7 * 4 * 64, 7)
    assert [r["steps"] for r in st2["runs"]] == [4, 3] and st2["settings"]["resume_from"] == str(state_dir)

    # another data order (seed) starts at batch 0 and says why
    other = Trainer(cfg.replace(seed=1, output_dir=str(tmp_path / "c"), steps=1, export_state=None),
                    TCFG, tparams, train, vocab)
    other.run()
    rec = json.loads((tmp_path / "c" / "train_log.jsonl").read_text().splitlines()[0])
    assert rec["start_batch"] == 0 and "seed" in rec["why"]


def test_state_pointing_at_a_committed_drafter_survives_a_move(setup, tmp_path):
    """A state may point at a drafter committed elsewhere (the shipped ones): a relative path."""
    from eagle_jax.train.trainer import Trainer

    tparams, train, vocab = setup
    Trainer(small_cfg(tmp_path / "repo" / "runs" / "a", steps=2, export=True, export_dtype="float32"),
            TCFG, tparams, train, vocab).run()
    shipped = tmp_path / "repo" / "eagle_jax" / "drafters" / "x"
    shutil.copytree(tmp_path / "repo" / "runs" / "a" / "drafter", shipped)
    S.write_state(tmp_path / "repo" / "train" / "state" / "eagle3", drafter=shipped, step=2, token_positions=512,
                  token_positions_source="test", cursor={"next_batch": 2})
    text = json.loads((tmp_path / "repo" / "train" / "state" / "eagle3" / S.STATE_FILE).read_text())
    assert text["drafter"] == "../../../eagle_jax/drafters/x"
    shutil.rmtree(tmp_path / "repo" / "runs")
    shutil.move(tmp_path / "repo", tmp_path / "clone")
    st = S.read_state(tmp_path / "clone" / "train" / "state" / "eagle3")
    assert st["drafter"] == str((tmp_path / "clone" / "eagle_jax" / "drafters" / "x").resolve())
    assert S.start_batch(st["cursor"], {"next_batch": 9, "seed": 0})[0] == 0  # an unknown order restarts


def test_state_errors(setup, tmp_path):
    from eagle_jax.train.config import TrainConfig

    with pytest.raises(ConfigError, match="no state.json"):
        S.read_state(tmp_path)
    (tmp_path / S.STATE_FILE).write_text(json.dumps({"schema": 1, "drafter": "nowhere", "step": 1,
                                                     "token_positions": 1, "token_positions_source": "x",
                                                     "cursor": {}}))
    with pytest.raises(ConfigError, match="holds no config.json"):
        S.read_state(tmp_path)
    (tmp_path / S.STATE_FILE).write_text(json.dumps({"schema": 1, "drafter": ".", "step": "1"}))
    with pytest.raises(ConfigError, match="'step' must be a int"):
        S.read_state(tmp_path)
    with pytest.raises(ConfigError, match="not both"):
        TrainConfig(init_from="a", resume_from="b").validate()
    with pytest.raises(ConfigError, match="need export"):
        TrainConfig(export=False, learning_curve=True).validate()
    import argparse

    from eagle_jax.train import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    cfg = cli.load_config(parser.parse_args(["--resume-from", "train/state/eagle3.1", "--export-state", "out",
                                             "--learning-curve"]))
    assert (cfg.resume_from, cfg.export_state, cfg.learning_curve) == ("train/state/eagle3.1", "out", True)
