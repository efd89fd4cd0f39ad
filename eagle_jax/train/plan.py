"""`eagle-jax plan --train`: what one device holds while a drafter trains on a DATAxMODEL mesh.

    eagle-jax plan --train --target llama-3.1-8b-instruct --variant eagle3.1 --draft-vocab-size 32000 \\
        --mesh 1x8 --batch 8 --seq-len 2048 --ttt-length 7 --dtype bfloat16

The run is the one `eagle-jax train` would make of the same `TrainConfig` (train/trainer.py):
its drafter from `build_drafter_config`, its optimiser from `make_optimizer`, the batch over
the data axis, the frozen target over the model axis, the drafter's state replicated or split
over the data axis (`fsdp`, `sharding.state_shardings`). Per device:

Exact, from the shapes (`jax.eval_shape`; nothing is allocated):

- target weights: the target in `dtype` by the logical-axis rules (plus a `target_dtype` copy
  for the feature pass when that differs);
- target head columns: the lm_head's draft-vocabulary columns [H, Vd] the features use, split
  over the model axis where it divides Vd;
- drafter params: the trained weights in `param_dtype`;
- optimizer state: optax's `tx.init` of them (Adam's two moments at the params' dtype, the
  counts) with the step and the key;
- batch features: what the feature pass hands the step, B/DATA rows of input ids, loss mask,
  lengths, aux [T, A*Ht] in `dtype`, the float32 draft-vocabulary logits [T, Vd] (split over
  the model axis as the head is) and the in-vocabulary flags.

Estimates, of the arrays the backward pass and the buffer assignment keep live at the peak
(XLA decides the real figure; on XLA:CPU the tests hold them within 25% of the compiled
programs' `memory_analysis()` temp bytes at small shapes, float32 and bfloat16: measured -12% to
+8%):

- feature pass activations (train/features.py): the larger of its layer stage (the target's KV
  cache of T slots it builds, and one layer's attention, q|k|v with its float32 scores and
  probabilities [heads, T, T], or its MLP, gate|up and their product) and its vocabulary stage
  (the normed hidden state and one chunk of float32 full-vocabulary logits twice, the product and
  its masked copy, for the in-vocabulary test, and, where a device's part of the head takes
  several chunks, the chunk's columns of the head it slices);
- TTT activations (train/ttt.py under `value_and_grad`): for each of the L unrolled steps three
  float32 [Hq, T, T] arrays of the attention over the step-0 keys (masked scores, their
  exponentials, the weights) and the layer's per-token arrays (the MLP's six of width F, the
  inputs, residuals and outputs of width H, q|k|v and the rotated k and v in the compute dtype;
  the norms' float32 copies and the attention's float32 output), then once the fc's normed input,
  one step's loss arrays (four float32 [T, Vd]), a float32 gradient per parameter (and its copy
  in bfloat16 params' dtype) and, when float32 params compute in bfloat16, their bfloat16 copy. The drafter is
  not split over the model axis: every model shard computes its data shard's rows.

The two passes run one after the other: total = the exact terms + the larger estimate.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from eagle_jax.config import TargetConfig
from eagle_jax.models import drafter, target
from eagle_jax.plan import param_bytes, weight_heads
from eagle_jax.sharding import CACHE_AXES, MeshShape, fsdp_dim, parse_mesh, per_device_elements
from eagle_jax.train.config import DTYPES, TrainConfig
from eagle_jax.train.features import chunk_columns
from eagle_jax.train.initialize import build_drafter_config
from eagle_jax.train.step import make_optimizer

__all__ = ["plan_train", "ESTIMATES", "VOCAB_CHUNK"]

ESTIMATES = ("feature pass activations", "TTT activations")
VOCAB_CHUNK = 8192  # columns a chunk of the in-vocabulary test (`features.make_feature_fn`'s default)
F32 = 4


def _state_bytes(tree, mesh: MeshShape, fsdp: bool) -> int:
    """Bytes one device holds of a training-state tree: each leaf whole, or with `fsdp` split over
    the data axis along `fsdp_dim` (`sharding.state_shardings`)."""
    def one(x):
        n = x.size * x.dtype.itemsize
        return n // mesh.data if fsdp and fsdp_dim(x.shape, mesh.data) is not None else n

    return sum(one(x) for x in jax.tree.leaves(tree))


def _split(n: int, ways: int) -> int:
    """What one shard holds of a dimension of n split `ways` ways (whole where it does not divide)."""
    return n // ways if n % ways == 0 else n


def _feature_activations(tcfg: TargetConfig, mesh: MeshShape, batch: int, t: int, argmax_mode: str,
                         itemsize: int) -> int:
    """The feature pass's estimate (module docstring), on one device: the larger of its layer
    stage and its vocabulary stage."""
    heads = weight_heads(tcfg)
    rows = _split(batch, mesh.data)
    cache = 2 * per_device_elements((tcfg.num_layers, batch, tcfg.num_kv_heads, t, tcfg.head_dim), CACHE_AXES,
                                    mesh, heads) * itemsize
    q_heads = per_device_elements((tcfg.q_size,), ("q_heads",), mesh, heads) // tcfg.head_dim
    qkv = per_device_elements((tcfg.q_size + 2 * tcfg.kv_size,), ("qkv",), mesh, heads)
    attention = rows * t * qkv * itemsize + 2 * rows * q_heads * t * t * F32
    ffw2 = per_device_elements((2 * tcfg.intermediate_size,), ("ffw2",), mesh)
    mlp = rows * t * (ffw2 + ffw2 // 2) * itemsize
    vocab = _split(tcfg.vocab_size, mesh.model)
    shards = tcfg.vocab_size // vocab  # the ranges the model axis splits the head into (`features.vocab_shards`)
    columns = {"skip": 0, "full": vocab, "chunked": chunk_columns(tcfg.vocab_size, shards, VOCAB_CHUNK)}
    sliced = argmax_mode == "chunked" and columns["chunked"] < vocab  # a chunk less than the part: a copy
    head = rows * t * (tcfg.hidden_size * itemsize + 2 * columns[argmax_mode] * F32) \
        + sliced * tcfg.hidden_size * columns["chunked"] * itemsize
    return max(cache + max(attention, mlp), head)


def _ttt_activations(dcfg, mesh: MeshShape, batch: int, t: int, steps: int, itemsize: int, params: int,
                     param_itemsize: int) -> int:
    """The TTT step's estimate (module docstring), on one device; `params`: how many parameters
    the drafter has (their gradients are float32 whatever their dtype: the matmuls' transposes
    accumulate in float32), of `param_itemsize` bytes (a step computing in a narrower dtype
    computes on a copy of them)."""
    cast = param_itemsize > itemsize
    rows = _split(batch, mesh.data)
    h, f, vd = dcfg.hidden_size, dcfg.intermediate_size, dcfg.draft_vocab_size
    qkv = dcfg.q_size + 2 * dcfg.kv_size
    layer = rows * t * (itemsize * (6 * f + 8 * h + qkv + 2 * dcfg.kv_size) + F32 * (4 * h + 4 * dcfg.q_size))
    per_step = 3 * rows * dcfg.num_heads * t * t * F32 + layer
    # float32 gradients, their copy in narrower params' dtype, the params' copy in the compute dtype
    grads = params * (F32 + (param_itemsize if param_itemsize < F32 else 0) + cast * itemsize)
    once = 2 * rows * t * dcfg.fc_in_size * itemsize + 4 * rows * t * vd * F32 + grads
    return steps * per_step + once


def plan_train(tcfg: TargetConfig, cfg: TrainConfig) -> dict:
    """Per-device bytes of a drafter training run of `cfg` (its mesh, batch, seq_len, ttt_length,
    dtypes, drafter settings) on the target `tcfg`, by part and in total (module docstring)."""
    cfg.validate()
    mesh = parse_mesh(cfg.mesh or "1x1")
    dcfg = build_drafter_config(tcfg, cfg)
    dtype, param_dtype = jnp.dtype(DTYPES[cfg.dtype]), jnp.dtype(DTYPES[cfg.param_dtype])
    feature_dtype = jnp.dtype(DTYPES[cfg.target_dtype or cfg.dtype])
    b, t = cfg.batch_size, cfg.seq_len
    heads = weight_heads(tcfg)
    key = jax.random.key(0)

    def target_bytes(dt):
        return param_bytes(target.Target, tcfg, jax.eval_shape(partial(target.init_params, tcfg, dtype=dt), key),
                           mesh, heads)

    tx, _ = make_optimizer(cfg)
    state = jax.eval_shape(lambda: _state(dcfg, tx, param_dtype))
    rows, vd = _split(b, mesh.data), dcfg.draft_vocab_size
    # input ids, loss mask, aux, logits; lengths; the in-vocabulary flags (whole [B, T] where
    # argmax_mode skip makes them a constant: XLA does not split it)
    feats = (rows * t * (2 * 4 + dcfg.fc_in_size * dtype.itemsize + _split(vd, mesh.model) * F32) + rows * 4
             + (b if cfg.argmax_mode == "skip" else rows) * t)
    params = _state_bytes(state["params"], mesh, cfg.fsdp)
    parts = {
        "target weights": target_bytes(dtype) + (target_bytes(feature_dtype) if feature_dtype != dtype else 0),
        "target head columns": tcfg.hidden_size * _split(vd, mesh.model) * feature_dtype.itemsize,
        "drafter params": params,
        "optimizer state": _state_bytes({k: v for k, v in state.items() if k != "params"}, mesh, cfg.fsdp),
        "batch features": feats,
        "feature pass activations": _feature_activations(tcfg, mesh, b, t, cfg.argmax_mode,
                                                         feature_dtype.itemsize),
        "TTT activations": _ttt_activations(dcfg, mesh, b, t, cfg.ttt_length, dtype.itemsize,
                                            sum(x.size for x in jax.tree.leaves(state["params"])),
                                            param_dtype.itemsize),
    }
    total = sum(v for k, v in parts.items() if k not in ESTIMATES) + max(parts[k] for k in ESTIMATES)
    notes = [f"batch {b}: {rows} row{'s' * (rows > 1)} a data shard"] if mesh.data > 1 else []
    if mesh.model > 1 and vd % mesh.model:
        notes.append(f"draft vocabulary {vd} does not divide the model axis {mesh.model}: its head and logits "
                     "are kept whole")
    return {"mesh": f"{mesh.data}x{mesh.model}", "devices": mesh.devices, "batch": b, "seq_len": t,
            "ttt_length": cfg.ttt_length, "variant": cfg.variant, "draft_vocab_size": vd, "dtype": cfg.dtype,
            "target_dtype": cfg.target_dtype or cfg.dtype, "param_dtype": cfg.param_dtype, "fsdp": cfg.fsdp,
            "bytes_per_device": parts, "estimates": list(ESTIMATES), "total_per_device": total, "notes": notes}


def _state(dcfg, tx, param_dtype) -> dict:
    """A training state of the trainer's layout (`Trainer._fresh_state`), for `jax.eval_shape`."""
    params = drafter.init_params(dcfg, jax.random.PRNGKey(0), dtype=param_dtype)
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
            "key": jax.random.PRNGKey(0)}
