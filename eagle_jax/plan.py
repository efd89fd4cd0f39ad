"""`eagle-jax plan`: what one device holds of a target and its drafter on a mesh, before renting it.

    eagle-jax plan --target llama-3.1-8b-instruct --draft eagle3-llama-3.1-8b-instruct \\
        --mesh 1x8 --batch 8 --context 8192

(the command: eagle_jax/cli/plan.py; `plan --train`, a drafter's training run: train/plan.py)

Shapes come from abstract evaluation (`jax.eval_shape` of the models' own
`init_params` and `create_cache`: nothing is allocated), their split from
eagle_jax/sharding.py's rules. A target or drafter is a config.json file, a
directory holding one, or the name of one shipped in eagle_jax/configs/
(Llama 3.1 8B / 70B and their EAGLE-3 drafters, DeepSeek-V3, Kimi K2 and K2.6
and K2.6's EAGLE 3.1 MLA drafter, as their Hugging Face repositories publish
them: sources in tests/test_plan.py) or eagle_jax/drafters/. Per device:

- weights: target and drafter parameters in `--dtype` (the drafter's
  embedding is the target's, unless its checkpoint carries its own; a MoE
  router stays float32), MoE experts split whole over the model axis;
- KV caches: target and drafter, `--batch` rows of `--context` slots plus a
  step's scratch (`--verify-tokens`); an MLA model's is the latent and rope
  key a token and layer (`models.mla.create_cache`), whole on every model
  shard (it has no head axis), rows split over data;
- drafter features: what the serving engine keeps of the target's features
  for its lazy drafter to read (`spec_decode/loop.py` `create_feats`): float32
  [A*Ht] and a token for every slot of every row, rows over the data axis;
- activations: an estimate from shapes of the largest set live at once in
  one verify step of `--verify-tokens` tokens a row: the residual stream and
  its normed copy, plus the largest of the attention stage (q|k|v, or MLA's
  projections and latent-space queries, and the float32 scores and
  probabilities over the context), the MLP stage (gate|up and their product;
  a MoE layer's per token-expert pair) and the float32 logits. XLA's own
  buffer assignment decides the real figure; the estimate is there to size,
  not to promise.

An MLA drafter (a config with `kv_lora_rank`: vLLM's Eagle3DeepseekV2ForCausalLM)
is counted as the tensors vLLM builds from its config (`MLADrafterTensors`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from eagle_jax.config import ConfigError, DrafterConfig, MLAConfig, TargetConfig
from eagle_jax.sharding import CACHE_AXES, MeshShape, logical_axes, per_device_elements

__all__ = ["GIB", "MLADrafterTensors", "plan", "param_bytes", "resolve_config", "weight_heads"]

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


def weight_heads(cfg) -> tuple[int, int, int]:
    """The (num_heads, num_kv_heads, head_dim) that `per_device_elements` splits a model's
    `qkv` and `q_heads` dimensions by. An MLA model's only head-split dimension of that kind
    is o_proj's rows, h * v_head_dim (its q_b / kv_b columns have their own axes)."""
    if getattr(cfg, "mla", None) is not None:
        return cfg.num_heads, cfg.num_heads, cfg.mla.v_head_dim
    return cfg.num_heads, cfg.num_kv_heads, cfg.head_dim


def _cache_bytes(cache, mesh: MeshShape) -> int:
    """Bytes one device holds of a KVCache's k and v [L, B, Hkv, S, D] by `CACHE_AXES`, heads
    counted from the arrays (an MLA cache's latents and rope keys have one "head", which no
    model axis above 1 splits: they are whole on every model shard, as `shard_cache` puts them)."""
    return sum(per_device_elements(x.shape, CACHE_AXES, mesh, (x.shape[2], x.shape[2], x.shape[-1]))
               * x.dtype.itemsize for x in (cache.k, cache.v))


def _activation_bytes(cfg, mesh: MeshShape, rows: int, tokens: int, context: int, vocab: int, itemsize: int) -> int:
    """The estimate of the module docstring, for one model (target or drafter). MLA attends
    from the latent: its stage holds the down-projection [q_a | latent | rope key], the
    queries, the float32 queries in latent space and the latent and value outputs; a MoE
    layer's holds each token-expert pair's gathered input, float32 gate|up and output, and
    the act in between (`models.moe.experts_mlp`)."""
    n = rows * tokens
    mla = getattr(cfg, "mla", None)
    if mla is None:
        heads = weight_heads(cfg)
        q_heads = per_device_elements((cfg.num_heads * cfg.head_dim,), ("q_heads",), mesh, heads) // cfg.head_dim
        attention = n * per_device_elements((cfg.q_size + 2 * cfg.kv_size,), ("qkv",), mesh, heads) * itemsize
    else:
        q_heads = per_device_elements((cfg.num_heads * mla.qk_head_dim,), ("mla_q",), mesh) // mla.qk_head_dim
        down = (mla.q_lora_rank or cfg.num_heads * mla.qk_head_dim) + mla.kv_lora_rank + mla.qk_rope_head_dim
        attention = (n * (down + q_heads * mla.qk_head_dim) * itemsize
                     + n * q_heads * (2 * mla.kv_lora_rank + mla.v_head_dim) * 4)
    attention += 2 * rows * q_heads * tokens * (context + tokens) * 4
    ffw2 = per_device_elements((2 * cfg.intermediate_size,), ("ffw2",), mesh)
    mlp = n * (ffw2 + ffw2 // 2) * itemsize
    moe = getattr(cfg, "moe", None)
    if moe is not None:
        h, f = cfg.hidden_size, moe.intermediate_size
        pairs = n * moe.experts_per_token
        mlp = max(mlp, pairs * ((h + f) * itemsize + (2 * f + h) * 4) + n * h * 4)
    logits = n * per_device_elements((vocab,), ("vocab",), mesh) * 4
    return 2 * n * cfg.hidden_size * itemsize + max(attention, mlp, logits)


@dataclass(frozen=True)
class MLADrafterTensors:
    """An EAGLE-3 / EAGLE 3.1 drafter whose decoder layer is MLA (vLLM's
    `Eagle3DeepseekV2ForCausalLM`: lightseekorg/kimi-k2.6-eagle3.1-mla), planned as the
    tensors vLLM's deepseek_eagle3.py builds from its config.json, since this checkout has
    no MLA drafter module to evaluate. Per layer: input, hidden and post-attention norms;
    MLA (`models.mla`'s leaves) over [embedding | hidden] (2H inputs) in the first layer,
    H after; a dense SwiGLU MLP. Then fc [A*Ht, H] (with `fc_norm` one norm per aux state),
    the final norm and lm_head [H, Vd]. Not counted: an embedding (the target's is read, as
    for the other drafters; a config does not say whether the checkpoint carries its own)
    and the d2t map. Its cache is the latent one of `mla.create_cache`, one per layer."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    mla: MLAConfig
    draft_vocab_size: int
    target_hidden_size: int
    num_aux: int
    fc_norm: bool

    @classmethod
    def from_dict(cls, d: dict, target_cfg: TargetConfig) -> "MLADrafterTensors":
        """The fields vLLM reads, with its defaults: draft_vocab_size the vocabulary,
        target_hidden_size the hidden size, three aux states unless named."""
        def need(key):
            if key not in d:
                raise ConfigError(f"MLA drafter config key {key!r} is missing")
            return d[key]

        if need("vocab_size") != target_cfg.vocab_size:
            raise ConfigError(f"the drafter's vocab_size {d['vocab_size']} is not the target's {target_cfg.vocab_size}")
        eagle = d.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(hidden_size=need("hidden_size"), intermediate_size=need("intermediate_size"),
                   num_heads=need("num_attention_heads"), num_layers=need("num_hidden_layers"),
                   mla=MLAConfig(kv_lora_rank=need("kv_lora_rank"), q_lora_rank=need("q_lora_rank"),
                                 qk_nope_head_dim=need("qk_nope_head_dim"),
                                 qk_rope_head_dim=need("qk_rope_head_dim"), v_head_dim=need("v_head_dim")),
                   draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
                   target_hidden_size=d.get("target_hidden_size") or target_cfg.hidden_size,
                   num_aux=d.get("num_aux_hidden_states") or (len(ids) if ids else 3),
                   fc_norm=bool(d.get("fc_norm", False)))

    @property
    def fc_in_size(self) -> int:
        return self.num_aux * self.target_hidden_size

    def tensors(self) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """{name: (shape, logical axes)} of every counted tensor (`sharding.RULES` names)."""
        h, m, heads = self.hidden_size, self.mla, self.num_heads
        q_a = m.q_lora_rank or heads * m.qk_head_dim
        out = {"fc": ((self.fc_in_size, h), ("aux", "embed")), "norm": ((h,), ("embed",)),
               "lm_head": ((h, self.draft_vocab_size), ("embed", "draft_vocab"))}
        if self.fc_norm:
            out["fc_norm"] = ((self.num_aux, self.target_hidden_size), ("aux_states", "target_embed"))
        for i in range(self.num_layers):
            inputs = (2 * h, "embed2") if i == 0 else (h, "embed")
            layer = {"input_layernorm": ((h,), ("embed",)), "post_attention_layernorm": ((h,), ("embed",)),
                     "wqkv_a": ((inputs[0], q_a + m.kv_lora_rank + m.qk_rope_head_dim), (inputs[1], "mla_a")),
                     "kv_a_norm": ((m.kv_lora_rank,), ("kv_lora",)),
                     "wkv_b": ((m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)), ("kv_lora", "mla_kv")),
                     "wo": ((heads * m.v_head_dim, h), ("q_heads", "embed")),
                     "w_gate_up": ((h, 2 * self.intermediate_size), ("embed", "ffw2")),
                     "w_down": ((self.intermediate_size, h), ("ffw", "embed"))}
            if i == 0:
                layer["hidden_norm"] = ((h,), ("embed",))
            if m.q_lora_rank is not None:
                layer.update(q_a_norm=((q_a,), ("q_lora",)), wq_b=((q_a, heads * m.qk_head_dim), ("q_lora", "mla_q")))
            out.update({f"layers.{i}.{name}": t for name, t in layer.items()})
        return out

    def weight_bytes(self, mesh: MeshShape, itemsize: int) -> int:
        return sum(per_device_elements(shape, axes, mesh, weight_heads(self))
                   for shape, axes in self.tensors().values()) * itemsize


def plan(target_cfg: TargetConfig, drafter_cfg: DrafterConfig | MLADrafterTensors | None, mesh: MeshShape, *,
         batch: int, context: int, verify_tokens: int = 16, dtype: str = "bfloat16") -> dict:
    """Per-device bytes by part (weights, KV caches, activations) and in total."""
    from eagle_jax.models import drafter, mla, target

    if batch < 1 or context < 1 or verify_tokens < 1:
        raise ConfigError(f"batch, context and verify tokens must be >= 1, got {batch}, {context}, {verify_tokens}")
    if context > target_cfg.max_position_embeddings:
        raise ConfigError(f"context {context} is longer than the target's {target_cfg.max_position_embeddings} positions")
    dt = jnp.dtype(dtype)
    key = jax.random.key(0)
    rows = batch // mesh.data if batch % mesh.data == 0 else batch
    slots = context + verify_tokens
    parts = {
        "target weights": param_bytes(target.Target, target_cfg,
                                      jax.eval_shape(partial(target.init_params, target_cfg, dtype=dt), key),
                                      mesh, weight_heads(target_cfg)),
        "target KV cache": _cache_bytes(jax.eval_shape(partial(target.create_cache, target_cfg, batch, slots, dt)),
                                        mesh),
        "target activations": _activation_bytes(target_cfg, mesh, rows, verify_tokens, slots,
                                                target_cfg.vocab_size, dt.itemsize),
    }
    if isinstance(drafter_cfg, MLADrafterTensors):
        parts["drafter weights"] = drafter_cfg.weight_bytes(mesh, dt.itemsize)
        parts["drafter KV cache"] = _cache_bytes(
            jax.eval_shape(partial(mla.create_cache, drafter_cfg.mla, drafter_cfg.num_layers, batch, slots, dt)), mesh)
    elif drafter_cfg is not None:
        parts["drafter weights"] = param_bytes(
            drafter.Drafter, drafter_cfg, jax.eval_shape(partial(drafter.init_params, drafter_cfg, dtype=dt), key),
            mesh, weight_heads(drafter_cfg))
        parts["drafter KV cache"] = _cache_bytes(
            jax.eval_shape(partial(drafter.create_cache, drafter_cfg, batch, slots, dt)), mesh)
    if drafter_cfg is not None:
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


def _notes(target_cfg: TargetConfig, drafter_cfg, mesh: MeshShape, batch: int) -> list[str]:
    """What the rules could not split evenly, and what they keep whole by design."""
    notes = []
    if batch % mesh.data:
        notes.append(f"batch {batch} does not divide the data axis ({mesh.data}): every data shard holds all rows")
    for name, cfg in (("target", target_cfg), ("drafter", drafter_cfg)):
        if cfg is None or mesh.model == 1:
            continue
        mla, moe = getattr(cfg, "mla", None), getattr(cfg, "moe", None)
        for what, heads in (("query", cfg.num_heads),) + (() if mla else (("KV", cfg.num_kv_heads),)):
            if heads % mesh.model and mesh.model % heads == 0:
                notes.append(f"{name}: {heads} {what} heads < model axis {mesh.model}: one head per shard, copied "
                             f"(the rules' layout; `generate --mesh` keeps such a KV cache whole today)")
            elif heads % mesh.model:
                notes.append(f"{name}: {heads} {what} heads do not divide the model axis {mesh.model}: kept whole")
        if mla is not None:
            notes.append(f"{name}: the MLA latent cache has no head axis: whole on each of the {mesh.model} "
                         f"model shards (rows split over data)")
        dense = cfg.intermediate_size if moe is None or len(moe.layers) < cfg.num_layers else None
        if dense is not None and dense % mesh.model:
            notes.append(f"{name}: MLP width {dense} does not divide the model axis: kept whole")
        if moe is not None and moe.num_experts % mesh.model:
            notes.append(f"{name}: {moe.num_experts} experts do not divide the model axis {mesh.model}: "
                         f"every device holds all of them")
        if moe is not None and moe.shared_intermediate_size % mesh.model:
            notes.append(f"{name}: shared-expert width {moe.shared_intermediate_size} does not divide the model "
                         f"axis: kept whole")
    return notes
