"""`eagle-jax plan`: what one device holds of a target and its drafter on a mesh, before renting it.

    eagle-jax plan --target llama-3.1-8b-instruct --draft eagle3-llama-3.1-8b-instruct \\
        --mesh 1x8 --batch 8 --context 8192

(the command: eagle_jax/cli/plan.py; `plan --train`, a drafter's training run: train/plan.py)

Shapes come from abstract evaluation (`jax.eval_shape` of the models' own
`init_params` and `create_cache`: nothing is allocated), their split from
eagle_jax/sharding.py's rules. A target or drafter is a config.json file, a
directory holding one, or the name of one shipped in eagle_jax/configs/
(Llama 3.1 8B / 70B and their EAGLE-3 drafters, as their Hugging Face
repositories publish them) or eagle_jax/drafters/. Per device:

- weights: target and drafter parameters in `--dtype` (the drafter's
  embedding is the target's, unless its checkpoint carries its own);
- KV caches: target and drafter, `--batch` rows of `--context` slots plus a
  step's scratch (`--verify-tokens`);
- drafter features: what the serving engine keeps of the target's features
  for its lazy drafter to read (`spec_decode/loop.py` `create_feats`): float32
  [A*Ht] and a token for every slot of every row, rows over the data axis;
- activations: an estimate from shapes of the largest set live at once in
  one verify step of `--verify-tokens` tokens a row: the residual stream and
  its normed copy, plus the largest of the attention stage (q|k|v and the
  float32 scores and probabilities over the context), the MLP stage (gate|up
  and their product) and the float32 logits. XLA's own buffer assignment
  decides the real figure; the estimate is there to size, not to promise.
"""

from __future__ import annotations

import json
import os
from functools import partial

import jax
import jax.numpy as jnp

from eagle_jax.config import ConfigError, DrafterConfig, TargetConfig
from eagle_jax.sharding import CACHE_AXES, MeshShape, logical_axes, per_device_elements

__all__ = ["GIB", "plan", "param_bytes", "resolve_config"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_SEARCH = (os.path.join(_HERE, "configs"), os.path.join(_HERE, "drafters"))
GIB = 1 << 30


def resolve_config(name_or_path: str) -> dict:
    """A config.json as a dict, from a file, a directory holding one, or a shipped name."""
    candidates = [name_or_path, os.path.join(name_or_path, "config.json")]
    for root in _SEARCH:
        candidates += [os.path.join(root, name_or_path + ".json"), os.path.join(root, name_or_path, "config.json")]
    path = next((c for c in candidates if os.path.isfile(c)), None)
    if path is None:
        shipped = sorted({n.removesuffix(".json") for root in _SEARCH for n in os.listdir(root)})
        raise FileNotFoundError(f"no config.json at {name_or_path!r}, and no shipped config of that name "
                                f"(shipped: {', '.join(shipped)})")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None


def param_bytes(model_type, cfg, tree, mesh: MeshShape, heads) -> int:
    """Bytes one device holds of an abstract parameter tree, by the logical axes the
    module (`model_type`) gives each leaf."""
    sizes = jax.tree.map(lambda leaf, axes: per_device_elements(leaf.shape, axes, mesh, heads) * leaf.dtype.itemsize,
                         tree, logical_axes(model_type(cfg, tree)))
    return sum(jax.tree.leaves(sizes))


def _cache_bytes(cache, mesh: MeshShape, heads) -> int:
    return sum(per_device_elements(x.shape, CACHE_AXES, mesh, heads) * x.dtype.itemsize for x in (cache.k, cache.v))


def _activation_bytes(cfg, mesh: MeshShape, rows: int, tokens: int, context: int, vocab: int, itemsize: int) -> int:
    """The estimate of the module docstring, for one model (target or drafter)."""
    heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    n = rows * tokens
    q_heads = per_device_elements((cfg.num_heads * cfg.head_dim,), ("q_heads",), mesh, heads) // cfg.head_dim
    qkv = per_device_elements((cfg.q_size + 2 * cfg.kv_size,), ("qkv",), mesh, heads)
    ffw2 = per_device_elements((2 * cfg.intermediate_size,), ("ffw2",), mesh)
    attention = n * qkv * itemsize + 2 * rows * q_heads * tokens * (context + tokens) * 4
    mlp = n * (ffw2 + ffw2 // 2) * itemsize
    logits = n * per_device_elements((vocab,), ("vocab",), mesh) * 4
    return 2 * n * cfg.hidden_size * itemsize + max(attention, mlp, logits)


def plan(target_cfg: TargetConfig, drafter_cfg: DrafterConfig | None, mesh: MeshShape, *, batch: int, context: int,
         verify_tokens: int = 16, dtype: str = "bfloat16") -> dict:
    """Per-device bytes by part (weights, KV caches, activations) and in total."""
    from eagle_jax.models import drafter, target

    if batch < 1 or context < 1 or verify_tokens < 1:
        raise ConfigError(f"batch, context and verify tokens must be >= 1, got {batch}, {context}, {verify_tokens}")
    if context > target_cfg.max_position_embeddings:
        raise ConfigError(f"context {context} is longer than the target's {target_cfg.max_position_embeddings} positions")
    dt = jnp.dtype(dtype)
    key = jax.random.key(0)
    rows = batch // mesh.data if batch % mesh.data == 0 else batch
    slots = context + verify_tokens
    theads = (target_cfg.num_heads, target_cfg.num_kv_heads, target_cfg.head_dim)
    parts = {
        "target weights": param_bytes(target.Target, target_cfg,
                                      jax.eval_shape(partial(target.init_params, target_cfg, dtype=dt), key),
                                      mesh, theads),
        "target KV cache": _cache_bytes(jax.eval_shape(partial(target.create_cache, target_cfg, batch, slots, dt)),
                                        mesh, theads),
        "target activations": _activation_bytes(target_cfg, mesh, rows, verify_tokens, slots,
                                                target_cfg.vocab_size, dt.itemsize),
    }
    if drafter_cfg is not None:
        dheads = (drafter_cfg.num_heads, drafter_cfg.num_kv_heads, drafter_cfg.head_dim)
        parts["drafter weights"] = param_bytes(
            drafter.Drafter, drafter_cfg, jax.eval_shape(partial(drafter.init_params, drafter_cfg, dtype=dt), key),
            mesh, dheads)
        parts["drafter KV cache"] = _cache_bytes(
            jax.eval_shape(partial(drafter.create_cache, drafter_cfg, batch, slots, dt)), mesh, dheads)
        parts["drafter activations"] = _activation_bytes(drafter_cfg, mesh, rows, verify_tokens, slots,
                                                         drafter_cfg.draft_vocab_size, dt.itemsize)
        # float32 features [rows, slots, A*Ht] and int32 tokens [rows, slots] (`loop.create_feats`)
        parts["drafter features"] = rows * slots * (drafter_cfg.fc_in_size * 4 + 4)
    # The two models run one after the other: their activations are not live together.
    acts = [v for k, v in parts.items() if k.endswith("activations")]
    total = sum(v for k, v in parts.items() if not k.endswith("activations")) + max(acts)
    return {"mesh": f"{mesh.data}x{mesh.model}", "devices": mesh.devices, "batch": batch, "context": context,
            "verify_tokens": verify_tokens, "dtype": dtype, "bytes_per_device": parts, "total_per_device": total,
            "notes": _notes(target_cfg, drafter_cfg, mesh, batch)}


def _notes(target_cfg: TargetConfig, drafter_cfg: DrafterConfig | None, mesh: MeshShape, batch: int) -> list[str]:
    """What the rules could not split evenly."""
    notes = []
    if batch % mesh.data:
        notes.append(f"batch {batch} does not divide the data axis ({mesh.data}): every data shard holds all rows")
    for name, cfg in (("target", target_cfg), ("drafter", drafter_cfg)):
        if cfg is None or mesh.model == 1:
            continue
        for what, heads in (("query", cfg.num_heads), ("KV", cfg.num_kv_heads)):
            if heads % mesh.model and mesh.model % heads == 0:
                notes.append(f"{name}: {heads} {what} heads < model axis {mesh.model}: one head per shard, copied "
                             f"(the rules' layout; `generate --mesh` keeps such a KV cache whole today)")
            elif heads % mesh.model:
                notes.append(f"{name}: {heads} {what} heads do not divide the model axis {mesh.model}: kept whole")
        if cfg.intermediate_size % mesh.model:
            notes.append(f"{name}: MLP width {cfg.intermediate_size} does not divide the model axis: kept whole")
    return notes
