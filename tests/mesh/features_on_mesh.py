"""The trainer's feature pass on simulated CPU devices (a subprocess of tests/mesh/test_mesh.py: the
device count is set before jax starts): a tiny target whose vocabulary takes several chunks of the
in-vocabulary test (train/features.py `_nondraft_max`), one batch's features unsharded and on each
mesh given, and of each compiled pass its collectives and its `memory_analysis()` temp bytes per
device. Prints one JSON object.

    python tests/mesh/features_on_mesh.py OUT_DIR 2x4 1x8 8x1
"""

from __future__ import annotations

import json
import os
import sys

out, meshes = sys.argv[1], sys.argv[2:]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from eagle_jax.config import TargetConfig  # noqa: E402
from eagle_jax.models import drafter, target  # noqa: E402
from eagle_jax.train.config import TrainConfig  # noqa: E402
from eagle_jax.train.step import iter_batches  # noqa: E402
from eagle_jax.train.trainer import Trainer  # noqa: E402

from collectives import compiled_collectives  # noqa: E402

# A vocabulary of 3 x 8192 + 8 ids: four chunks of the default 8192 columns, split by a model axis
# of 2, 4 or 8; a chunk of it (6146 ids) is not, so chunks cut across the model shards' ranges. Tied
# embeddings, the head the trainer takes from the embedding; float32 (XLA:CPU copies a bfloat16
# operand of a slice whole to float32, which would hide the copies this measures).
TCFG = TargetConfig(vocab_size=3 * 8192 + 8, hidden_size=128, intermediate_size=320, num_layers=2, num_heads=8,
                    num_kv_heads=8, head_dim=16, max_position_embeddings=512, name_or_path="tiny-random",
                    tie_word_embeddings=True)
BATCH, SEQ, DRAFT_VOCAB = 8, 16, 96

params = target.init_params(TCFG, jax.random.PRNGKey(0), scale=0.5)
rng = np.random.default_rng(1)
train = [{"id": f"r{i}", "input_ids": rng.integers(0, TCFG.vocab_size, SEQ).astype(np.int32),
          "loss_mask": np.ones(SEQ, np.int32)} for i in range(BATCH)]
batch = next(iter_batches(train, BATCH, SEQ, seed=0))
# The draft vocabulary holds every other one of the target's greedy tokens over the batch (and
# random others), so that the full-vocabulary argmax is in it at some positions and not at others.
model = target.Target(TCFG, params)
hidden, _, _ = model(jnp.asarray(batch["input_ids"]), jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ)),
                     target.create_cache(TCFG, BATCH, SEQ, jnp.float32))
greedy = np.unique(np.asarray(jnp.argmax(model.logits(hidden), -1)))[::2]
others = rng.permutation(np.setdiff1d(np.arange(TCFG.vocab_size), greedy))[: DRAFT_VOCAB - len(greedy)]
vocab = drafter.DraftVocab.from_target_ids(np.sort(np.concatenate([greedy, others])), TCFG.vocab_size)


def run(mesh):
    cfg = TrainConfig(output_dir=os.path.join(out, mesh or "one"), steps=1, batch_size=BATCH, seq_len=SEQ,
                      draft_vocab_size=DRAFT_VOCAB, ttt_length=1, progress=False, eval_prompts=0,
                      eval_at_start=False, export=False, seed=0, aux_layer_ids=[0, 1], impl="xla", mesh=mesh,
                      dtype="float32", num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=96)
    tr = Trainer(cfg, TCFG, params, train, vocab)
    feats = tr.batch_features(batch)
    args = (tr.feature_params, feats["input_ids"], tr.draft_head, tr.t2d, tr.forward_params)
    with jax.set_mesh(tr.mesh) if tr.mesh is not None else jax.default_device(jax.devices()[0]):
        compiled = tr.feature_fn.lower(*args).compile()
    embed = tr.feature_params["embed"]
    return {"aux": np.asarray(feats["aux"]).tolist(), "logits": np.asarray(feats["target_logits"]).tolist(),
            "in_vocab": np.asarray(feats["in_vocab"]).tolist(),
            "collectives": compiled_collectives(compiled.as_text()),
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "head_shard_bytes": embed.addressable_shards[0].data.nbytes}


weights = sorted({tuple(x.shape[1:]) for x in params["layers"].values()} | {tuple(params["embed"].shape)})
print(json.dumps({"weight_shapes": weights, "reference": run(None), "meshes": {m: run(m) for m in meshes}}))
