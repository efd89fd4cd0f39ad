"""train/state.py: a committed training state, exported by one run and resumed on a fresh checkout.

The tiny random target of test_trainer.py. The reference for a resumed run is a hand-driven loop: the
state's drafter weights (read back from its safetensors file), a fresh optimiser, and the batches of
``data.batches`` from the state's cursor on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

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
    copied = Path(st["drafter"])  # the drafter copied into the state, under a versioned name
    assert copied.parent == state_dir.resolve() and copied.name.startswith("drafter-4-") and st["optimizer"] is None
    exported = load_file(str(copied / "model.safetensors"))
    assert np.array_equal(exported["fc.weight"].T, _params(first)["fc"])  # speculators layout [out, in]

    cfg = small_cfg(tmp_path / "b", steps=3, export=True, export_dtype="float32", resume_from=str(state_dir),
                    export_state=str(state_dir), warmup_steps=1)
    second = Trainer(cfg, TCFG, tparams, train, vocab)
    # reference: the state's weights, a fresh optimiser, batches 4, 5, 6 of the data order
    ref = Trainer(cfg.replace(resume_from=None, export_state=None, init_from=str(copied),
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


def test_state_pointing_at_a_committed_drafter_survives_a_move(tmp_path):
    """A state may point at a drafter committed elsewhere (the shipped ones): a relative path."""
    shipped = _fake_drafter(tmp_path / "repo" / "eagle_jax" / "drafters" / "x", "shipped")
    S.write_state(tmp_path / "repo" / "train" / "state" / "eagle3", drafter=shipped, step=2, token_positions=512,
                  token_positions_source="test", cursor={"next_batch": 2})
    text = json.loads((tmp_path / "repo" / "train" / "state" / "eagle3" / S.STATE_FILE).read_text())
    assert text["drafter"] == "../../../eagle_jax/drafters/x"
    shutil.move(tmp_path / "repo", tmp_path / "clone")
    st = S.read_state(tmp_path / "clone" / "train" / "state" / "eagle3")
    assert st["drafter"] == str((tmp_path / "clone" / "eagle_jax" / "drafters" / "x").resolve())
    assert S.start_batch(st["cursor"], {"next_batch": 9, "seed": 0})[0] == 0  # an unknown order restarts


def test_state_errors(tmp_path):
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


# ----------------------------------------------------------------------------- a kill at every point of a write

_CHILD = textwrap.dedent("""
    import os, shutil, signal, sys
    from eagle_jax.train import state as S

    path, drafter, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    calls = [0]

    def counted(fn):
        def run(*args, **kwargs):
            calls[0] += 1
            if calls[0] == kill_at:  # killed just before this filesystem operation
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return run

    for module, name in ((os, "replace"), (os, "fsync"), (shutil, "copy2"), (shutil, "rmtree")):
        setattr(module, name, counted(getattr(module, name)))
    S.write_state(path, drafter=drafter, step=2, token_positions=20, token_positions_source="new",
                  cursor={"next_batch": 2}, copy_drafter=True)
    print(calls[0])
""")


def _fake_drafter(path: Path, tag: str) -> Path:
    """A drafter directory's files (read_state checks config.json; every byte is compared here)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"tag": tag}))
    (path / "model.safetensors").write_bytes(os.urandom(4096))
    (path / "model_card.md").write_text(f"# {tag}\n")
    return path


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all((a / n).read_bytes() == (b / n).read_bytes()
                                                                 for n in names)


def test_a_kill_at_any_point_of_a_write_leaves_the_old_state_or_the_new_one(tmp_path):
    """write_state run in a child killed (SIGKILL) before each of its filesystem operations in turn:
    every time, the state reads back whole, as the old one or the new one, with its own drafter's
    bytes; the run that is not killed leaves the new state and one drafter copy."""
    old, new = _fake_drafter(tmp_path / "old", "old"), _fake_drafter(tmp_path / "new", "new")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    outcomes, kill_at = [], 1
    while True:
        state_dir = tmp_path / f"state{kill_at}"
        S.write_state(state_dir, drafter=old, step=1, token_positions=10, token_positions_source="old",
                      cursor={"next_batch": 1}, copy_drafter=True)
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(state_dir), str(new), str(kill_at)],
                              capture_output=True, text=True, timeout=120, env=env)
        st = S.read_state(state_dir)
        source = {1: old, 2: new}[st["step"]]
        assert _same_files(Path(st["drafter"]), source), (kill_at, st)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        outcomes.append(st["step"])
        kill_at += 1
    assert len(outcomes) >= 6 and outcomes[0] == 1 and outcomes[-1] == 2, outcomes  # kills on both sides
    assert st["step"] == 2 and [p.name for p in state_dir.iterdir() if p.is_dir()] == [Path(st["drafter"]).name]
