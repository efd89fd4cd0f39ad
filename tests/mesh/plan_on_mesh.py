"""`plan --train` against a real training run on simulated CPU devices (a subprocess of
tests/test_plan.py: the device count is set before jax starts). For each mesh given
(DATAxMODEL, ":fsdp" for a state split over the data axis) a tiny target's drafter trainer is
built and one batch's features computed; per device: the bytes of its real arrays (target,
head columns, drafter params, optimizer state, batch features) and the compiled feature pass's
and train step's `memory_analysis()` temp bytes, beside `plan_train` of the same config. Prints
one JSON object. With --state-only, only the training state, the target and its head columns are
measured (nothing is compiled but their initialisation).

    python tests/mesh/plan_on_mesh.py [--state-only] OUT_DIR 2x4:fsdp 1x1@seq_len=160,ttt_length=5
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

state_only = sys.argv[1] == "--state-only"
out, runs = sys.argv[1 + state_only], sys.argv[2 + state_only:]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from eagle_jax.config import TargetConfig  # noqa: E402
from eagle_jax.models import drafter, target  # noqa: E402
from eagle_jax.train import vocab as V  # noqa: E402
from eagle_jax.train.config import DTYPES, TrainConfig  # noqa: E402
from eagle_jax.train.plan import plan_train  # noqa: E402
from eagle_jax.train.step import iter_batches  # noqa: E402
from eagle_jax.train.trainer import Trainer  # noqa: E402

# 8 query and 4 KV heads, MLP 320, vocabulary 4096: a model axis of 2 or 4 splits every projection
# in whole heads; the dims differ from each other so that no two terms have one size.
TCFG = TargetConfig(vocab_size=4096, hidden_size=96, intermediate_size=320, num_layers=4, num_heads=8,
                    num_kv_heads=4, head_dim=16, max_position_embeddings=512, name_or_path="tiny-random")
BASE = dict(batch_size=8, seq_len=96, draft_vocab_size=384, ttt_length=3, variant="eagle3.1", dtype="float32",
            impl="xla", steps=2, progress=False, eval_prompts=0, eval_at_start=False, export=False,
            resume=False, save_every=1000)


def examples(n, length, seed=1):
    rng = np.random.default_rng(seed)
    return [{"id": f"r{i}", "input_ids": rng.integers(0, TCFG.vocab_size, length).astype(np.int32),
             "loss_mask": (np.arange(length) >= 4).astype(np.int32)} for i in range(n)]


def per_device(tree) -> int:
    """The most bytes any one device holds of the arrays of `tree` (their shards on it; an array
    the tree holds twice counted once)."""
    held: dict = {}
    for x in {id(x): x for x in jax.tree.leaves(tree)}.values():
        for s in x.addressable_shards:
            held[s.device] = held.get(s.device, 0) + s.data.nbytes
    return max(held.values())


params = jax.jit(lambda key: target.init_params(TCFG, key, scale=0.5))(jax.random.PRNGKey(0))  # one compile


def measure(name: str) -> dict:
    mesh, _, settings = name.partition("@")
    mesh, _, fsdp = mesh.partition(":")
    extra = {k: (v if k.endswith("dtype") or k == "argmax_mode" else int(v))
             for k, v in (kv.split("=") for kv in settings.split(",") if kv)}
    cfg = TrainConfig(**{**BASE, **extra}, mesh=mesh, fsdp=bool(fsdp),
                      output_dir=os.path.join(out, name.replace(":", "-").replace("@", "-")))
    train = examples(4 * cfg.batch_size, cfg.seq_len)
    d2t, _ = V.build_draft_vocab(V.token_frequencies(train, TCFG.vocab_size), cfg.draft_vocab_size, TCFG.vocab_size)
    vocab = drafter.DraftVocab.from_target_ids(V.draft_to_target_ids(d2t), TCFG.vocab_size)
    # the target in the run's dtype, as `eagle-jax train` loads it (train/cli.py `prepare`)
    tr = Trainer(cfg, TCFG, jax.tree.map(lambda x: x.astype(DTYPES[cfg.dtype]), params), train, vocab)
    state = tr.init_state()
    measured = {"target weights": per_device([tr.tparams, tr.feature_params]),
                "target head columns": per_device(tr.draft_head), "drafter params": per_device(state["params"]),
                "optimizer state": per_device({k: v for k, v in state.items() if k != "params"})}
    if state_only:
        return {"plan": plan_train(TCFG, cfg), "measured": measured}
    batch = next(iter_batches(train, cfg.batch_size, cfg.seq_len, seed=0))
    with jax.set_mesh(tr.mesh) if tr.mesh is not None else contextlib.nullcontext():
        feats = tr.batch_features(batch)
        features = tr.feature_fn.lower(tr.feature_params, feats["input_ids"], tr.draft_head, tr.t2d,
                                       tr.forward_params).compile().memory_analysis()
        step = tr.train_step.lower(state, tr.tparams["embed"], feats).compile().memory_analysis()
    measured.update({"batch features": per_device(feats), "feature pass activations": features.temp_size_in_bytes,
                     "TTT activations": step.temp_size_in_bytes})
    return {"plan": plan_train(TCFG, cfg), "measured": measured}


print(json.dumps({name: measure(name) for name in runs}))
