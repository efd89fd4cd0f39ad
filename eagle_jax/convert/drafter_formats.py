"""EAGLE-3 / EAGLE 3.1 drafter checkpoints: SafeAILab native, SpecForge and speculators.

`load_drafter(path, target_cfg)` reads a checkpoint directory (`config.json`
plus `model.safetensors`, a sharded `model.safetensors.index.json`, or
`pytorch_model.bin` / its index) into `(DrafterConfig, params, DraftVocab)`
with the parameter layout of docs/PARAMS.md. `save_drafter` writes the
speculators format (what vLLM serves by path) or the SafeAILab native format.

Checkpoint keys (EAGLE.md section 5; PyTorch Linear weights are [out, in]):

    fc.weight                          [H, A*Ht]
    {L}.self_attn.{q,k,v,o}_proj.weight, (.bias when attention_bias)
    {L}.mlp.{gate,up,down}_proj.weight
    {L}.{input_layernorm,hidden_norm,post_attention_layernorm}.weight
    norm.weight, lm_head.weight        [H], [Vd, H]
    d2t (int64 offsets [Vd]), t2d (bool [V])        optional only when Vd == V
    embed_tokens.weight [V, H]         optional; sets has_embedding
    fc_norm.{i}.weight [Ht]            iff fc_norm
    input_norm.weight [A*Ht]           iff norm_before_fc
    mask_hidden [1, 1, A*Ht]           iff a parallel drafter (P-EAGLE, `mask_token_id`):
                                       speculators' parameter shape (vLLM views it as
                                       [1, A*Ht]); read in any shape of A*Ht elements
                                       and leading 1s

An MLA drafter (`DrafterConfig.mla`, vLLM's `Eagle3DeepseekV2ForCausalLM`) has, in
place of the q/k/v/o projections (R = kv_lora_rank, QA = q_lora_rank, h heads,
Dn / Dr / Dv the qk_nope / qk_rope / v head dims):

    {L}.self_attn.q_a_proj.weight [QA, 2H], q_a_layernorm.weight [QA],
        q_b_proj.weight [h*(Dn+Dr), QA]     (q_proj.weight [h*(Dn+Dr), 2H] when
                                             q_lora_rank is null)
    {L}.self_attn.kv_a_proj_with_mqa.weight [R+Dr, 2H], kv_a_layernorm.weight [R],
        kv_b_proj.weight [h*(Dn+Dv), R], o_proj.weight [H, h*Dv]

with {L} = `midlayer` (native, SpecForge) or `layers.0` (speculators); either
prefix is accepted on load whatever the config dialect. Loading is strict:
missing, extra or mis-shaped tensors, a `d2t` of the wrong length, ids out of
range or inconsistent with `t2d` raise `CheckpointError` naming the key. The
only tolerated extra keys are `*.rotary_emb.inv_freq` buffers (derivable).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from eagle_jax.config import CheckpointError, ConfigError, DrafterConfig, TargetConfig
from eagle_jax.convert.drafter_config import (
    detect_config_format,
    drafter_config_from_dict,
    drafter_config_to_native,
    drafter_config_to_speculators,
)
from eagle_jax.convert.atomic import atomic_directory
from eagle_jax.convert.safetensors_io import SafetensorsError, SafetensorsFile, save_safetensors
from eagle_jax.models.drafter import Drafter, DraftVocab
from eagle_jax.sharding import shard_model

__all__ = [
    "CheckpointError",
    "FORMATS",
    "checkpoint_format",
    "checkpoint_tensor_shapes",
    "load_drafter",
    "load_drafter_tensors",
    "params_from_tensors",
    "save_drafter",
    "tensors_from_params",
    "validate_vocab",
]

FORMATS = ("speculators", "native")
_LAYER_PREFIX = {"speculators": "layers.0", "native": "midlayer"}
_TORCH_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                      np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float64): "float64"}


# ----------------------------------------------------------------------------- key table

def _attention_shapes(cfg: DrafterConfig, p: str) -> dict[str, tuple[tuple[int, ...], str]]:
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    return {
        f"{p}.self_attn.q_proj.weight": ((q, 2 * h), "[num_heads * head_dim, 2 * hidden_size]"),
        f"{p}.self_attn.k_proj.weight": ((kv, 2 * h), "[num_kv_heads * head_dim, 2 * hidden_size]"),
        f"{p}.self_attn.v_proj.weight": ((kv, 2 * h), "[num_kv_heads * head_dim, 2 * hidden_size]"),
        f"{p}.self_attn.o_proj.weight": ((h, q), "[hidden_size, num_heads * head_dim]"),
    }


def _mla_shapes(cfg: DrafterConfig, p: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The MLA projections' keys (module docstring)."""
    m, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    a = f"{p}.self_attn."
    qk, r, dr = heads * m.qk_head_dim, m.kv_lora_rank, m.qk_rope_head_dim
    shapes = {
        a + "kv_a_proj_with_mqa.weight": ((r + dr, 2 * h), "[kv_lora_rank + qk_rope_head_dim, 2 * hidden_size]"),
        a + "kv_a_layernorm.weight": ((r,), "[kv_lora_rank]"),
        a + "kv_b_proj.weight": ((heads * (m.qk_nope_head_dim + m.v_head_dim), r),
                                 "[num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]"),
        a + "o_proj.weight": ((h, heads * m.v_head_dim), "[hidden_size, num_heads * v_head_dim]"),
    }
    if m.q_lora_rank is None:
        shapes[a + "q_proj.weight"] = ((qk, 2 * h), "[num_heads * (qk_nope + qk_rope head dims), 2 * hidden_size]")
    else:
        shapes.update({
            a + "q_a_proj.weight": ((m.q_lora_rank, 2 * h), "[q_lora_rank, 2 * hidden_size]"),
            a + "q_a_layernorm.weight": ((m.q_lora_rank,), "[q_lora_rank]"),
            a + "q_b_proj.weight": ((qk, m.q_lora_rank), "[num_heads * (qk_nope + qk_rope head dims), q_lora_rank]")})
    return shapes


def checkpoint_tensor_shapes(cfg: DrafterConfig, layer_prefix: str = "layers.0",
                             ) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict[str, tuple[tuple[int, ...], str]]]:
    """(required, optional) maps key -> (shape, description) for a checkpoint of `cfg`.

    `embed_tokens.weight` is required when `cfg.has_embedding`, optional otherwise;
    `d2t`/`t2d` are required when the draft vocabulary is smaller than the target's.
    """
    h, f, ht, a = cfg.hidden_size, cfg.intermediate_size, cfg.target_hidden_size, cfg.num_aux
    q, kv, vd, v = cfg.q_size, cfg.kv_size, cfg.draft_vocab_size, cfg.vocab_size
    p = layer_prefix
    req: dict[str, tuple[tuple[int, ...], str]] = {
        "fc.weight": ((h, a * ht), "[hidden_size, num_aux * target_hidden_size]"),
        **(_attention_shapes(cfg, p) if cfg.mla is None else _mla_shapes(cfg, p)),
        f"{p}.mlp.gate_proj.weight": ((f, h), "[intermediate_size, hidden_size]"),
        f"{p}.mlp.up_proj.weight": ((f, h), "[intermediate_size, hidden_size]"),
        f"{p}.mlp.down_proj.weight": ((h, f), "[hidden_size, intermediate_size]"),
        f"{p}.input_layernorm.weight": ((h,), "[hidden_size]"),
        f"{p}.hidden_norm.weight": ((h,), "[hidden_size]"),
        f"{p}.post_attention_layernorm.weight": ((h,), "[hidden_size]"),
        "norm.weight": ((h,), "[hidden_size]"),
        "lm_head.weight": ((vd, h), "[draft_vocab_size, hidden_size]"),
    }
    if cfg.qkv_bias:
        req[f"{p}.self_attn.q_proj.bias"] = ((q,), "[num_heads * head_dim]")
        req[f"{p}.self_attn.k_proj.bias"] = ((kv,), "[num_kv_heads * head_dim]")
        req[f"{p}.self_attn.v_proj.bias"] = ((kv,), "[num_kv_heads * head_dim]")
    if cfg.o_bias:
        req[f"{p}.self_attn.o_proj.bias"] = ((h,), "[hidden_size]")
    if cfg.fc_norm:
        for i in range(a):
            req[f"fc_norm.{i}.weight"] = ((ht,), "[target_hidden_size]")
    if cfg.norm_before_fc:
        req["input_norm.weight"] = ((a * ht,), "[num_aux * target_hidden_size]")
    if cfg.parallel_drafting:
        req["mask_hidden"] = ((1, 1, a * ht), "[1, 1, num_aux * target_hidden_size]")
    opt: dict[str, tuple[tuple[int, ...], str]] = {
        "d2t": ((vd,), "[draft_vocab_size]"),
        "t2d": ((v,), "[vocab_size]"),
        "embed_tokens.weight": ((v, h), "[vocab_size, hidden_size]"),
    }
    if cfg.has_embedding:
        req["embed_tokens.weight"] = opt.pop("embed_tokens.weight")
    return req, opt


# ----------------------------------------------------------------------------- reading

def _torch_to_numpy(name: str, t) -> np.ndarray:
    import torch

    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"pytorch_model.bin entry {name!r} is a {type(t).__name__}, not a tensor")
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _read_bin(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise CheckpointError(
            f"{path} is a PyTorch pickle; reading it needs torch (pip install torch), or convert "
            "the checkpoint to model.safetensors first") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - report any unpickling failure with the path
        raise CheckpointError(f"cannot read {path} with torch.load(weights_only=True): {e}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a flat state dict (got {type(state).__name__})")
    return {k: _torch_to_numpy(k, t) for k, t in state.items()}


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    try:
        f = SafetensorsFile(path)
        return {k: f[k] for k in f}
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None


def _read_index(index: Path, reader) -> dict[str, np.ndarray]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid shard index ({e})") from None
    out: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = index.parent / shard
        if not shard_path.is_file():
            raise CheckpointError(f"{index} names shard {shard!r}, which does not exist")
        tensors = reader(shard_path)
        for name, arr in tensors.items():
            if name in out:
                raise CheckpointError(f"tensor {name!r} appears in more than one shard")
            out[name] = arr
    listed, found = set(weight_map), set(out)
    if listed - found:
        raise CheckpointError(f"{index} lists tensors that no shard holds: {sorted(listed - found)}")
    if found - listed:
        raise CheckpointError(f"shards hold tensors that {index} does not list: {sorted(found - listed)}")
    return out


def load_drafter_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory as numpy arrays, by on-disk key."""
    d = Path(path)
    for name, read in (("model.safetensors", _read_safetensors),
                       ("model.safetensors.index.json", lambda p: _read_index(p, _read_safetensors)),
                       ("pytorch_model.bin", _read_bin),
                       ("pytorch_model.bin.index.json", lambda p: _read_index(p, _read_bin))):
        if (d / name).is_file():
            return read(d / name)
    raise CheckpointError(f"{d} has no model.safetensors, model.safetensors.index.json or "
                          "pytorch_model.bin")


# ----------------------------------------------------------------------------- vocab

def validate_vocab(d2t: np.ndarray | None, t2d: np.ndarray | None, cfg: DrafterConfig) -> DraftVocab:
    """Check d2t/t2d against cfg and return the DraftVocab (int32 offsets, bool mask)."""
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    if d2t is None:
        if vd != v:
            raise CheckpointError(
                f"missing key 'd2t': draft_vocab_size {vd} != vocab_size {v}, so the draft-to-"
                "target id map is required")
        if t2d is not None and not np.all(np.asarray(t2d).astype(bool)):
            raise CheckpointError("t2d marks target ids absent from the draft vocabulary but there "
                                  "is no d2t (draft vocab == target vocab needs t2d all true)")
        return DraftVocab.identity(v)
    d2t = np.asarray(d2t)
    if d2t.ndim != 1 or d2t.shape[0] != vd:
        raise CheckpointError(f"d2t has shape {list(d2t.shape)}, expected [{vd}] (draft_vocab_size)")
    if not np.issubdtype(d2t.dtype, np.integer):
        raise CheckpointError(f"d2t must hold integer offsets, got dtype {d2t.dtype}")
    target_ids = np.arange(vd, dtype=np.int64) + d2t.astype(np.int64)
    bad = np.flatnonzero((target_ids < 0) | (target_ids >= v))
    if bad.size:
        i = int(bad[0])
        raise CheckpointError(
            f"d2t maps draft id {i} to target id {int(target_ids[i])}, outside [0, {v}) "
            f"({bad.size} ids out of range)")
    if np.unique(target_ids).size != vd:
        raise CheckpointError("d2t maps several draft ids to the same target id")
    expected_t2d = np.zeros((v,), bool)
    expected_t2d[target_ids] = True
    if t2d is not None:
        t2d = np.asarray(t2d)
        if t2d.shape != (v,):
            raise CheckpointError(f"t2d has shape {list(t2d.shape)}, expected [{v}] (vocab_size)")
        if t2d.dtype != np.bool_:
            if not np.issubdtype(t2d.dtype, np.integer) or not np.isin(t2d, (0, 1)).all():
                raise CheckpointError(f"t2d must be a boolean mask, got dtype {t2d.dtype}")
            t2d = t2d.astype(bool)
        if not np.array_equal(t2d, expected_t2d):
            diff = np.flatnonzero(t2d != expected_t2d)
            raise CheckpointError(
                f"t2d is inconsistent with d2t at {diff.size} target ids (first: {int(diff[0])}); "
                "t2d must be True exactly at arange(draft_vocab_size) + d2t")
    return DraftVocab(d2t=jnp.asarray(d2t.astype(np.int32)), t2d=jnp.asarray(expected_t2d))


# ----------------------------------------------------------------------------- tensors <-> params

def _float(name: str, a: np.ndarray, dtype) -> np.ndarray:
    """A floating tensor on the host, in `dtype` (None: its own)."""
    if not np.issubdtype(a.dtype, np.floating) and a.dtype != np.dtype(ml_dtypes.bfloat16):
        raise CheckpointError(f"{name} has dtype {a.dtype}; expected a floating-point tensor")
    a = np.asarray(a)
    return a if dtype is None else a.astype(np.dtype(dtype))


def params_from_tensors(cfg: DrafterConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32, *,
                        mesh=None) -> tuple[DrafterConfig, dict, DraftVocab]:
    """Validate on-disk tensors against `cfg` and build (cfg, params, vocab).

    `cfg.has_embedding` is set from the presence of `embed_tokens.weight`. The
    parameters are assembled on the host, then put on the default device, or
    with a jax `mesh` each device receives only its shards (`sharding.shard_model`:
    the fused projections laid out for its model axis, `cfg.fused_groups` set).
    """
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    has_mid = any(k.startswith("midlayer.") for k in tensors)
    has_layers = any(k.startswith("layers.") for k in tensors)
    if has_mid and has_layers:
        raise CheckpointError("the checkpoint mixes midlayer.* and layers.* keys")
    prefix = "midlayer" if has_mid else "layers.0"
    cfg = cfg.replace(has_embedding="embed_tokens.weight" in tensors)
    req, opt = checkpoint_tensor_shapes(cfg, prefix)
    missing = sorted(set(req) - set(tensors))
    if missing:
        raise CheckpointError(f"missing key(s) {missing} in the drafter checkpoint")
    extra = sorted(set(tensors) - set(req) - set(opt))
    if extra:
        hints = []
        if any(k.startswith("fc_norm.") for k in extra):
            hints.append("fc_norm.* weights but the config has fc_norm false"
                         if not cfg.fc_norm else f"more fc_norm.* than {cfg.num_aux} aux states")
        if "input_norm.weight" in extra:
            hints.append("input_norm.weight but the config has norm_before_fc false")
        if any(k.endswith(".bias") for k in extra):
            hints.append("bias tensors but the config has attention_bias false")
        if "mask_hidden" in extra:
            hints.append("mask_hidden (a parallel drafter's) but the config names no placeholder token "
                         "(speculators_model_type peagle with mask_token_id, or pard_token)")
        if any(k.startswith(("layers.", "midlayer.")) and not k.startswith(prefix + ".") for k in extra):
            hints.append("tensors of a second decoder layer (num_hidden_layers must be 1)")
        raise CheckpointError(f"unexpected key(s) {extra} in the drafter checkpoint"
                              + (f" ({'; '.join(hints)})" if hints else ""))
    for key, arr in tensors.items():
        shape, desc = req.get(key) or opt[key]
        if key in ("d2t", "t2d"):
            continue  # checked by validate_vocab with a vocabulary-specific message
        if key == "mask_hidden" and arr.size == shape[-1] and set(arr.shape[:-1]) <= {1}:
            continue  # any number of leading 1s
        if tuple(arr.shape) != shape:
            raise CheckpointError(f"{key} has shape {list(arr.shape)}, expected {list(shape)} {desc}")
    vocab = validate_vocab(tensors.get("d2t"), tensors.get("t2d"), cfg)

    def w(key):  # [out, in] -> [in, out]
        return _float(key, np.ascontiguousarray(tensors[key].T), dtype)

    def vec(key):
        return _float(key, tensors[key], dtype)

    p = prefix
    a = f"{p}.self_attn."
    if cfg.mla is None:
        attention = {"wqkv": np.concatenate([w(f"{a}{n}_proj.weight") for n in "qkv"], axis=1)}
    else:
        q_a = a + ("q_proj" if cfg.mla.q_lora_rank is None else "q_a_proj")
        attention = {"wqkv_a": np.concatenate([w(q_a + ".weight"), w(a + "kv_a_proj_with_mqa.weight")], axis=1),
                     "kv_a_norm": vec(a + "kv_a_layernorm.weight"), "wkv_b": w(a + "kv_b_proj.weight")}
        if cfg.mla.q_lora_rank is not None:
            attention.update(q_a_norm=vec(a + "q_a_layernorm.weight"), wq_b=w(a + "q_b_proj.weight"))
    layer = {
        "input_layernorm": vec(f"{p}.input_layernorm.weight"),
        "hidden_norm": vec(f"{p}.hidden_norm.weight"),
        **attention,
        "wo": w(f"{p}.self_attn.o_proj.weight"),
        "post_attention_layernorm": vec(f"{p}.post_attention_layernorm.weight"),
        "w_gate_up": np.concatenate([w(f"{p}.mlp.gate_proj.weight"), w(f"{p}.mlp.up_proj.weight")],
                                    axis=1),
        "w_down": w(f"{p}.mlp.down_proj.weight"),
    }
    if cfg.qkv_bias:
        layer["bqkv"] = np.concatenate([vec(f"{p}.self_attn.{n}_proj.bias") for n in "qkv"])
    if cfg.o_bias:
        layer["bo"] = vec(f"{p}.self_attn.o_proj.bias")
    params = {"fc": w("fc.weight"), "layer": layer, "norm": vec("norm.weight"),
              "lm_head": w("lm_head.weight")}
    if cfg.fc_norm:
        params["fc_norm"] = np.stack([vec(f"fc_norm.{i}.weight") for i in range(cfg.num_aux)])
    if cfg.norm_before_fc:
        params["input_norm"] = vec("input_norm.weight")
    if cfg.has_embedding:
        params["embed"] = vec("embed_tokens.weight")
    if cfg.parallel_drafting:
        params["mask_hidden"] = vec("mask_hidden").reshape(-1)
    if mesh is None:
        return cfg, jax.tree.map(jnp.asarray, params), vocab
    cfg, params = shard_model(Drafter, cfg, params, mesh)
    return cfg, params, vocab


def load_drafter(path: str | os.PathLike, target_cfg: TargetConfig | None = None, dtype=jnp.float32,
                 *, aux_layer_semantics: str | None = None, mesh=None) -> tuple[DrafterConfig, dict, DraftVocab]:
    """Load a SafeAILab / SpecForge / speculators drafter checkpoint directory.

    Returns (cfg, params, vocab); params follow docs/PARAMS.md in `dtype`
    (None keeps the checkpoint's own floating dtype).
    `target_cfg` is optional: it supplies the default aux ids and the max length
    and is checked for consistency; without it a config naming no aux ids loads
    with `aux_layer_ids=()` (the default of the target it will run with, see
    `DrafterConfig.for_target`), since the weights only depend on their number.
    RoPE is the drafter config's own. See `drafter_config_from_dict` for the
    aux id readings and `aux_layer_semantics`; the reading applied is logged.
    With a jax `mesh`, each device receives only its shards (`params_from_tensors`).
    """
    d = Path(path)
    if d.is_file() and d.name == "config.json":
        d = d.parent
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{d} has no config.json")
    try:
        config_dict = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from None
    cfg = drafter_config_from_dict(config_dict, target_cfg, aux_layer_semantics=aux_layer_semantics)
    return params_from_tensors(cfg, load_drafter_tensors(d), dtype, mesh=mesh)


# ----------------------------------------------------------------------------- writing

def _np(x, dtype=None) -> np.ndarray:
    a = np.asarray(x)
    if dtype is not None:
        a = a.astype(np.dtype(dtype))
    return np.ascontiguousarray(a)


def tensors_from_params(cfg: DrafterConfig, params: dict, vocab: DraftVocab,
                        format: str = "speculators", dtype=None) -> dict[str, np.ndarray]:
    """The on-disk tensors ([out, in] weights, int64 d2t, bool t2d) of a drafter.

    `d2t`/`t2d` are always written in the native format, and in the speculators
    format unless the draft vocabulary is the target's (identity map).
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if format == "speculators" and cfg.mla is not None:
        raise ConfigError("speculators has no MLA drafter format: save an MLA drafter with format='native'")
    p = _LAYER_PREFIX[format]
    layer = params["layer"]
    q, kv, f = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    gu = np.asarray(layer["w_gate_up"])

    def t(a):
        return _np(np.asarray(a).T, dtype)

    out = {
        "fc.weight": t(params["fc"]),
        **(_attention_tensors(cfg, layer, p, t) if cfg.mla is None else _mla_tensors(cfg, layer, p, t, dtype)),
        f"{p}.self_attn.o_proj.weight": t(layer["wo"]),
        f"{p}.mlp.gate_proj.weight": t(gu[:, :f]),
        f"{p}.mlp.up_proj.weight": t(gu[:, f:]),
        f"{p}.mlp.down_proj.weight": t(layer["w_down"]),
        f"{p}.input_layernorm.weight": _np(layer["input_layernorm"], dtype),
        f"{p}.hidden_norm.weight": _np(layer["hidden_norm"], dtype),
        f"{p}.post_attention_layernorm.weight": _np(layer["post_attention_layernorm"], dtype),
        "norm.weight": _np(params["norm"], dtype),
        "lm_head.weight": t(params["lm_head"]),
    }
    if cfg.qkv_bias:
        b = np.asarray(layer["bqkv"])
        out[f"{p}.self_attn.q_proj.bias"] = _np(b[:q], dtype)
        out[f"{p}.self_attn.k_proj.bias"] = _np(b[q:q + kv], dtype)
        out[f"{p}.self_attn.v_proj.bias"] = _np(b[q + kv:], dtype)
    if cfg.o_bias:
        out[f"{p}.self_attn.o_proj.bias"] = _np(layer["bo"], dtype)
    if cfg.fc_norm:
        g = np.asarray(params["fc_norm"])
        for i in range(cfg.num_aux):
            out[f"fc_norm.{i}.weight"] = _np(g[i], dtype)
    if cfg.norm_before_fc:
        out["input_norm.weight"] = _np(params["input_norm"], dtype)
    if cfg.has_embedding:
        out["embed_tokens.weight"] = _np(params["embed"], dtype)
    if cfg.parallel_drafting:
        out["mask_hidden"] = _np(np.asarray(params["mask_hidden"]).reshape(1, 1, -1), dtype)
    d2t, t2d = _np(vocab.d2t, np.int64), _np(vocab.t2d, np.bool_)
    validate_vocab(d2t, t2d, cfg)
    identity = cfg.draft_vocab_size == cfg.vocab_size and not d2t.any()
    if format == "native" or not identity:
        # speculators registers no d2t/t2d buffers when the vocabularies are equal
        # (vLLM then keeps its identity map); SafeAILab always registers both.
        out["d2t"], out["t2d"] = d2t, t2d
    # Validate what is about to be written with the reader's own rules.
    req, opt = checkpoint_tensor_shapes(cfg, p)
    for key, arr in out.items():
        shape, desc = req.get(key) or opt[key]
        if key not in ("d2t", "t2d") and tuple(arr.shape) != shape:
            raise ConfigError(f"params for {key} have shape {list(arr.shape)}, expected "
                              f"{list(shape)} {desc}")
    return out


def _attention_tensors(cfg: DrafterConfig, layer: dict, p: str, t) -> dict[str, np.ndarray]:
    """q/k/v_proj of the fused wqkv (`t` transposes and casts)."""
    q, kv = cfg.q_size, cfg.kv_size
    wqkv = np.asarray(layer["wqkv"])
    if wqkv.shape != (2 * cfg.hidden_size, q + 2 * kv):
        raise ConfigError(f"params layer.wqkv has shape {list(wqkv.shape)}, expected "
                          f"{[2 * cfg.hidden_size, q + 2 * kv]}")
    return {f"{p}.self_attn.q_proj.weight": t(wqkv[:, :q]), f"{p}.self_attn.k_proj.weight": t(wqkv[:, q:q + kv]),
            f"{p}.self_attn.v_proj.weight": t(wqkv[:, q + kv:])}


def _mla_tensors(cfg: DrafterConfig, layer: dict, p: str, t, dtype) -> dict[str, np.ndarray]:
    """The MLA projections but o_proj (`t` transposes and casts)."""
    m, a = cfg.mla, f"{p}.self_attn."
    wqkv_a = np.asarray(layer["wqkv_a"])
    q_a = wqkv_a.shape[1] - m.kv_lora_rank - m.qk_rope_head_dim
    out = {a + ("q_proj" if m.q_lora_rank is None else "q_a_proj") + ".weight": t(wqkv_a[:, :q_a]),
           a + "kv_a_proj_with_mqa.weight": t(wqkv_a[:, q_a:]),
           a + "kv_a_layernorm.weight": _np(layer["kv_a_norm"], dtype), a + "kv_b_proj.weight": t(layer["wkv_b"])}
    if m.q_lora_rank is not None:
        out.update({a + "q_a_layernorm.weight": _np(layer["q_a_norm"], dtype), a + "q_b_proj.weight": t(layer["wq_b"])})
    return out


def _fsync_write(path: Path, data: bytes | None = None) -> None:
    if data is not None:
        with open(path, "wb") as fh:
            fh.write(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_drafter(out_dir: str | os.PathLike, cfg: DrafterConfig, params: dict, vocab: DraftVocab,
                 format: str = "speculators", dtype=None, *, overwrite: bool = False) -> Path:
    """Write `config.json` + `model.safetensors` for vLLM (speculators) or SafeAILab (native).

    dtype None keeps each parameter's dtype; otherwise floats are cast to it.
    The directory appears atomically: files are written into a temporary
    directory next to `out_dir`, then renamed. An existing `out_dir` raises
    FileExistsError unless `overwrite` (then it is replaced, also by rename).
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True to replace it)")
    tensors = tensors_from_params(cfg, params, vocab, format, dtype)
    torch_dtype = _TORCH_DTYPE_NAMES.get(tensors["lm_head.weight"].dtype)
    to_dict = drafter_config_to_speculators if format == "speculators" else drafter_config_to_native
    config = to_dict(cfg, torch_dtype=torch_dtype)

    with atomic_directory(out) as tmp:
        _fsync_write(tmp / "config.json", (json.dumps(config, indent=2) + "\n").encode())
        save_safetensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
        _fsync_write(tmp / "model.safetensors")
    return out


def checkpoint_format(path: str | os.PathLike) -> str:
    """"speculators", "specforge" or "native", from a checkpoint's config.json."""
    return detect_config_format(json.loads((Path(path) / "config.json").read_text()))
