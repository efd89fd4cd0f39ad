"""Train a drafter on simulated CPU devices (a subprocess of tests/mesh/test_mesh.py: the device
count is set before jax starts): a few steps of a tiny target's drafter unsharded and on each
mesh given, the per-step losses and gradient norms; then a run checkpointed on the first mesh
and resumed on the second. Prints one JSON object.

    python tests/mesh/train_on_mesh.py OUT_DIR 2x4 8x1 [2x4:fsdp]

With `--join HOST:PORT N I` (after OUT_DIR) it is process I of N, the 8 devices split between
the processes (`eagle_jax.runtime.initialize_distributed`): it trains on the meshes only (the
reference comes from one process), each process building only its rows of each batch, the
checkpoints written by every process into the one OUT_DIR.
"""

from __future__ import annotations

import json
import os
import sys

out, meshes = sys.argv[1], sys.argv[2:]
join = None
if meshes[:1] == ["--join"]:
    join, meshes = (meshes[1], int(meshes[2]), int(meshes[3])), meshes[4:]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // (join[1] if join else 1)}"

import jax  # noqa: E402

if join:
    from eagle_jax.runtime import initialize_distributed  # noqa: E402

    initialize_distributed(*join)
import numpy as np  # noqa: E402

from eagle_jax.config import TargetConfig  # noqa: E402
from eagle_jax.models import drafter, target  # noqa: E402
from eagle_jax.train import vocab as V  # noqa: E402
from eagle_jax.train.config import TrainConfig  # noqa: E402
from eagle_jax.train.step import iter_batches  # noqa: E402
from eagle_jax.train.trainer import Trainer  # noqa: E402

from collectives import compiled_collectives  # noqa: E402

# 8 query and 4 KV heads, MLP 128: a model axis of 4 splits every projection in whole heads. The
# drafter's own dims (4 heads, MLP 96, draft vocabulary 96) give its weights shapes no target
# weight has, so that the collectives' shapes tell them apart.
TCFG = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8,
                    num_kv_heads=4, head_dim=8, max_position_embeddings=512, name_or_path="tiny-random")
STEPS = 4


def examples(n=48, seed=1):
    """Random sequences: a prompt (mask 0) and a response (mask 1), 30 to 60 tokens."""
    rng = np.random.default_rng(seed)
    out_ = []
    for i in range(n):
        length, prompt = int(rng.integers(30, 60)), int(rng.integers(4, 10))
        ids = rng.integers(0, TCFG.vocab_size, length).astype(np.int32)
        out_.append({"id": f"r{i}", "input_ids": ids, "loss_mask": (np.arange(length) >= prompt).astype(np.int32)})
    return out_


params = target.init_params(TCFG, jax.random.PRNGKey(0), scale=0.5)
train = examples()
d2t, _ = V.build_draft_vocab(V.token_frequencies(train, TCFG.vocab_size), 96, TCFG.vocab_size)
vocab = drafter.DraftVocab.from_target_ids(V.draft_to_target_ids(d2t), TCFG.vocab_size)


def run(name, mesh, steps=STEPS, resume=False, stop_after=None):
    mesh, _, fsdp = (mesh or "").partition(":")
    cfg = TrainConfig(output_dir=os.path.join(out, name), steps=steps, batch_size=8, seq_len=64,
                      draft_vocab_size=96, ttt_length=3, lr=3e-3, warmup_steps=2, save_every=2, max_to_keep=3,
                      progress=False, eval_prompts=0, eval_at_start=False, export=False, seed=0,
                      aux_layer_ids=[1, 2, 3], impl="xla", mesh=mesh or None, fsdp=bool(fsdp), resume=resume,
                      dtype="float32", num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=96)
    tr = Trainer(cfg, TCFG, params, train, vocab)
    tr.run(stop_after=stop_after)
    log = [json.loads(line) for line in open(tr.log_path)] if tr.lead else []  # process 0 writes it
    shardings = {str(getattr(x.sharding, "spec", "one device")) for x in jax.tree.leaves(tr.state["params"])}
    moved = {}
    if tr.mesh is not None:  # the collectives of the compiled feature pass and train step
        batch = next(iter_batches(train, 8, 64, seed=0, rows=tr.local_rows))
        with jax.set_mesh(tr.mesh):
            feats = tr.batch_features(batch)
            for program, args in ((tr.feature_fn, (tr.feature_params, feats["input_ids"], tr.draft_head, tr.t2d,
                                                   tr.forward_params)),
                                  (tr.train_step, (tr.state, tr.tparams["embed"], feats))):
                for kind, shapes in compiled_collectives(program.lower(*args).compile().as_text()).items():
                    moved.setdefault(kind, []).extend(shapes)
    return {"collectives": moved, "resumes": [r["step"] for r in log if r["type"] == "resume"],
            "loss": [r["loss"] for r in log if r["type"] == "train"],
            "grad_norm": [r["grad_norm"] for r in log if r["type"] == "train"],
            "param_specs": sorted(shardings), "devices": len(jax.tree.leaves(tr.state["params"])[0].devices())}


weights = sorted({tuple(x.shape[1:]) for x in params["layers"].values()}
                 | {tuple(params["embed"].shape), tuple(params["lm_head"].shape)})
result = {"weight_shapes": weights, "reference": run("one", None) if not join else None,
          "meshes": {m: run(m.replace(":", "-"), m) for m in meshes}, "process": jax.process_index()}
if len(meshes) >= 2:  # two steps on the first mesh, checkpointed; resumed on the second for the rest
    first, second = meshes[0], meshes[1]
    run("resumed", first, stop_after=2)
    result["resumed"] = {"from": first, "on": second, **run("resumed", second, resume=True)}
print(json.dumps(result))
