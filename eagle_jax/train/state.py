"""Committed training state: what a fresh clone needs to continue training a drafter.

    eagle-jax train --config train/configs/smollm2-eagle31-stage2.yaml --resume-from train/state/eagle3.1
    eagle-jax train ... --set export_state=train/state/eagle3.1     # the run's end state replaces it

A state is a directory holding ``state.json``:

* ``drafter``: the drafter weights the state stands for, a path relative to
  the state directory: ``drafter-<step>-<tag>`` (a copy written by
  ``export_state``, speculators format, bf16 or the run's ``export_dtype``;
  ``drafter`` in states written before versioned copies) or a drafter
  committed elsewhere (``../../../eagle_jax/drafters/smollm2-135m-eagle3.1``),
  so a shipped drafter is not committed twice;
* ``step`` and ``token_positions``: optimiser steps and token positions
  (batch rows x padded length, summed over steps) behind those weights, over
  every run that led to them; ``token_positions_source`` says where the
  figure comes from;
* ``cursor``: where the last run's data order stopped, ``next_batch`` with
  what identifies that order (``data``, ``max_conversations``, ``seed``,
  ``batch_size``, ``seq_len``, ``examples_sha1``: train/data.py ``batches``);
* ``data`` (the last run's sources and counts), ``settings`` (its config),
  ``runs`` (one line per run: date, steps, token positions, output dir);
* ``optimizer``: null. Adam's moments are twice the weights (about 80 MB in
  float32 for SmolLM2's drafter), too big to commit: a continued run restarts
  the optimiser, with ``warmup_steps`` of warm-up.

Resuming (``resume_from``) starts a fresh run from the state's drafter (as
``init_from``: its weights and draft vocabulary) and continues the data order
at ``cursor.next_batch`` when the cursor describes the same order as this
run's (same data, seed, batch size, seq_len and examples); otherwise the run starts
at batch 0 and its log says why. Steps and token positions add to the state's.

Writing a state (`write_state`) replaces it atomically: the new drafter copy is
made under a new name and ``state.json`` is switched by one rename, each
fsynced first, so a kill at any point leaves the old state or the new one.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from eagle_jax.config import ConfigError

__all__ = ["STATE_FILE", "CURSOR_KEYS", "is_state_dir", "read_state", "write_state", "examples_sha1",
           "start_batch", "training_record"]

STATE_FILE = "state.json"
DRAFTER_PREFIX = "drafter-"  # a drafter copied into a state: drafter-<step>-<tag> (the first one was "drafter")
SCHEMA = 1
CURSOR_KEYS = ("data", "max_conversations", "seed", "batch_size", "seq_len", "examples_sha1")
_REQUIRED = {"schema": int, "drafter": str, "step": int, "token_positions": int, "token_positions_source": str,
             "cursor": dict}


def is_state_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / STATE_FILE).is_file()


def read_state(path: str | os.PathLike) -> dict:
    """The state at `path` with ``drafter`` resolved to an absolute path; ConfigError if it is not one."""
    f = Path(path) / STATE_FILE
    if not f.is_file():
        raise ConfigError(f"resume_from {path}: no {STATE_FILE} there (a training state directory, train/state.py)")
    st = json.loads(f.read_text())
    for key, t in _REQUIRED.items():
        if not isinstance(st.get(key), t) or isinstance(st.get(key), bool):
            raise ConfigError(f"{f}: {key!r} must be a {t.__name__}, got {st.get(key)!r}")
    drafter = (f.parent / st["drafter"]).resolve()
    if not (drafter / "config.json").is_file():
        raise ConfigError(f"{f}: its drafter {st['drafter']} ({drafter}) holds no config.json")
    return dict(st, drafter=str(drafter))


def write_state(path: str | os.PathLike, *, drafter: str | os.PathLike, step: int, token_positions: int,
                token_positions_source: str, cursor: Mapping, data: Sequence | None = None,
                settings: Mapping | None = None, runs: Sequence[Mapping] = (), copy_drafter: bool = False) -> Path:
    """Replace the state at `path` with a new one, atomically: a kill at any moment leaves the old
    state or the new one, whole. With `copy_drafter` the drafter directory is copied into the state
    (``drafter-<step>-<tag>``); otherwise the state points at it.

    Order: the copy is written beside the old one under a temporary name, its files and directory
    fsynced, then renamed to its final name; ``state.json`` is written beside the old one, fsynced
    and renamed over it (the switch); only then are the drafter copies no state names removed."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(drafter).resolve()
    if copy_drafter:
        dst = out / f"{DRAFTER_PREFIX}{int(step)}-{secrets.token_hex(3)}"
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.copytree(src, tmp)
        _fsync_tree(tmp)
        os.replace(tmp, dst)
        _fsync_dir(out)
        src = dst.resolve()
    st = {"schema": SCHEMA, "drafter": os.path.relpath(src, out.resolve()), "step": int(step),
          "token_positions": int(token_positions), "token_positions_source": token_positions_source,
          "cursor": dict(cursor), "data": list(data) if data is not None else None,
          "settings": dict(settings) if settings is not None else None, "runs": [dict(r) for r in runs],
          "optimizer": None, "updated": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()}
    tmp = out / (STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(st, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / STATE_FILE)
    _fsync_dir(out)
    for old in out.iterdir():  # copies (and half-written ones) the state no longer names
        if old.is_dir() and old.name.startswith(DRAFTER_PREFIX[:-1]) and old.resolve() != src:
            shutil.rmtree(old)
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first."""
    dirs = []
    for d, _, files in os.walk(root):
        dirs.append(Path(d))
        for name in files:
            with open(Path(d) / name, "rb") as f:
                os.fsync(f.fileno())
    for d in reversed(dirs):
        _fsync_dir(d)


def examples_sha1(examples: Sequence[Mapping]) -> str:
    """A digest of the tokenised training examples (input_ids and loss_mask, in order)."""
    h = hashlib.sha1()
    for e in examples:
        for key in ("input_ids", "loss_mask"):
            a = np.ascontiguousarray(np.asarray(e[key], np.int32))
            h.update(len(a).to_bytes(8, "little"))
            h.update(a.tobytes())
    return h.hexdigest()[:16]


def start_batch(state_cursor: Mapping, run_cursor: Mapping) -> tuple[int, str]:
    """(first batch of this run, why): the state's ``next_batch`` when the data order is the same."""
    diff = [k for k in CURSOR_KEYS if state_cursor.get(k) != run_cursor.get(k)]
    if diff:
        return 0, "data order differs from the state's (" + ", ".join(diff) + "): starting at batch 0"
    return int(state_cursor["next_batch"]), "same data order as the state's: continuing it"


def training_record(st: Mapping) -> dict:
    """The ``training`` field of a learning-curve point for the drafter of state `st`."""
    return {"token_positions": st["token_positions"], "token_positions_source": st["token_positions_source"],
            "steps": st["step"], "data": st.get("data"), "settings": st.get("settings"),
            "runs": st.get("runs", [])}
