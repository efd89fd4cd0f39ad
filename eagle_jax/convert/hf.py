"""Hugging Face checkpoints -> `TargetConfig` + the target parameter pytree.

Supported: `LlamaForCausalLM` (Llama 2/3.x, SmolLM2), `Qwen2ForCausalLM`,
`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM` and `DeepseekV3ForCausalLM` (DeepSeek-V3,
and Kimi K2, whose config says `model_type` "kimi_k2") saved as `model.safetensors`
or sharded (`model.safetensors.index.json`) in fp32, fp16 or bf16. The layout
produced is the one in docs/PARAMS.md: `[in, out]` weights, q/k/v fused into `wqkv`,
gate/up fused into `w_gate_up`, layers stacked on a leading axis (one dict per layer
for the MoE and MLA models, `TargetConfig.per_layer`: see `models/moe.py` and
`models/mla.py` for their leaves).

Loading is strict: a missing tensor, an unexpected tensor or a wrong shape
raises `CheckpointError` naming the tensor; an unsupported configuration raises
`ConfigError` naming the config key and value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from eagle_jax.config import CheckpointError, ConfigError, MLAConfig, MoEConfig, RopeConfig, TargetConfig
from eagle_jax.convert.safetensors_io import SafetensorsError, SafetensorsFile

__all__ = [
    "CheckpointError",
    "SUPPORTED_ARCHITECTURES",
    "target_config_from_hf",
    "rope_config_from_hf",
    "expected_hf_shapes",
    "params_from_hf_tensors",
    "open_hf_safetensors",
    "load_hf_directory",
    "resolve_dtype",
]


# architecture -> (model_type, defaults that differ between the HF config classes)
SUPPORTED_ARCHITECTURES: dict[str, dict] = {
    "LlamaForCausalLM": {"model_type": "llama", "max_position_embeddings": 2048,
                         "num_key_value_heads": None, "head_dim": None,
                         "bos_token_id": 1, "eos_token_id": 2},
    "Qwen2ForCausalLM": {"model_type": "qwen2", "max_position_embeddings": 32768,
                         "num_key_value_heads": 32, "head_dim": None,
                         "bos_token_id": None, "eos_token_id": None},
    "Qwen3ForCausalLM": {"model_type": "qwen3", "max_position_embeddings": 32768,
                         "num_key_value_heads": 32, "head_dim": 128,
                         "bos_token_id": None, "eos_token_id": None},
    "Qwen3MoeForCausalLM": {"model_type": "qwen3_moe", "max_position_embeddings": 32768,
                            "num_key_value_heads": 4, "head_dim": None,
                            "bos_token_id": None, "eos_token_id": None},
    "DeepseekV3ForCausalLM": {"model_type": "deepseek_v3", "max_position_embeddings": 4096,
                              "num_key_value_heads": None, "head_dim": None,
                              "bos_token_id": 0, "eos_token_id": 1},
}
# Kimi K2's config.json names its own model_type for the DeepSeek-V3 architecture
# (transformers' Kimi-K2.5 config and vLLM read it as deepseek_v3).
_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
_ARCH_BY_MODEL_TYPE = {v["model_type"]: k for k, v in SUPPORTED_ARCHITECTURES.items()}
_ARCH_BY_MODEL_TYPE.update({alias: _ARCH_BY_MODEL_TYPE[m] for alias, m in _MODEL_TYPE_ALIASES.items()})

_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")

# Buffers some exporters leave in the state dict; they carry no weights.
_HARMLESS_EXTRA = re.compile(r"(^|\.)rotary_emb\.inv_freq$|(^|\.)masked_bias$")


def resolve_dtype(dtype) -> np.dtype:
    """'float32' | 'bfloat16' | 'float16' (or the numpy/jax dtype) -> np.dtype."""
    try:
        dt = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {_SUPPORTED_DTYPES}") from None
    if dt.name not in _SUPPORTED_DTYPES:
        raise ValueError(f"unsupported parameter dtype {dt.name!r}; use one of {_SUPPORTED_DTYPES}")
    return dt


# ----------------------------------------------------------------------------- config


def _require(config: Mapping, key: str):
    if config.get(key) is None:
        raise ConfigError(f"config key {key!r} is missing")
    return config[key]


def _positive_int(config: Mapping, key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        if isinstance(value, float) and value.is_integer() and value > 0:
            return int(value)
        raise ConfigError(f"config key {key!r} must be a positive integer, got {value!r}")
    return value


def _as_float(key: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config key {key!r} must be a number, got {value!r}") from None


def rope_config_from_hf(config: Mapping) -> RopeConfig:
    """Parse the rotary embedding of a HF config.

    Accepts transformers 5 `rope_parameters` (with `rope_type` and `rope_theta`
    inside) and the older `rope_theta` + `rope_scaling` (with `type` or
    `rope_type`). Types: default, linear, llama3, yarn.
    """
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    key = "rope_parameters" if params is not None else "rope_scaling"
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"config key {name!r} must be a mapping, got {value!r}")
        if value and any(isinstance(v, Mapping) for v in value.values()):
            raise ConfigError(
                f"config key {name!r} defines a separate rotary embedding per layer type "
                f"({sorted(value)}); only one global rotary embedding is supported"
            )
    merged: dict = dict(scaling or {})
    merged.update(params or {})

    theta = merged.get("rope_theta", config.get("rope_theta"))
    theta = 10000.0 if theta is None else _as_float("rope_theta", theta)
    rope_type = merged.get("rope_type", merged.get("type")) or "default"
    type_key = f"{key}.rope_type" if "rope_type" in merged else f"{key}.type"

    prf = merged.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if prf is not None and float(prf) != 1.0:
        raise ConfigError(f"config key 'partial_rotary_factor' = {prf!r} is unsupported "
                          "(only full rotary embeddings, 1.0)")

    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type not in ("linear", "llama3", "yarn"):
        why = (" (dynamic NTK scaling depends on the running sequence length and cannot be "
               "expressed with static shapes)" if rope_type == "dynamic" else "")
        raise ConfigError(f"unsupported rope type: config key {type_key!r} = {rope_type!r}{why}; "
                          "supported: default, linear, llama3, yarn")

    max_pos = config.get("max_position_embeddings")
    factor = merged.get("factor")
    if factor is not None:
        factor = _as_float(f"{key}.factor", factor)
        if factor <= 0:
            raise ConfigError(f"config key '{key}.factor' must be positive, got {factor!r}")

    if rope_type == "linear":
        if factor is None:
            raise ConfigError(f"config key '{key}.factor' is missing (required by linear rope)")
        return RopeConfig(theta=theta, scaling_type="linear", factor=factor)

    orig = config.get("original_max_position_embeddings") or merged.get(
        "original_max_position_embeddings") or max_pos
    if orig is None:
        raise ConfigError(f"config key '{key}.original_max_position_embeddings' is missing")
    orig = _positive_int(config, f"{key}.original_max_position_embeddings", orig)

    if rope_type == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor"):
            if merged.get(k) is None:
                raise ConfigError(f"config key '{key}.{k}' is missing (required by llama3 rope)")
        low = _as_float(f"{key}.low_freq_factor", merged["low_freq_factor"])
        high = _as_float(f"{key}.high_freq_factor", merged["high_freq_factor"])
        if not high > low:
            raise ConfigError(f"config key '{key}.high_freq_factor' ({high}) must exceed "
                              f"'{key}.low_freq_factor' ({low})")
        return RopeConfig(theta=theta, scaling_type="llama3", factor=factor, low_freq_factor=low,
                          high_freq_factor=high, original_max_position_embeddings=orig)

    # yarn
    if merged.get("truncate", True) is not True:
        raise ConfigError(f"config key '{key}.truncate' = {merged['truncate']!r} is unsupported "
                          "(only the default truncated YaRN correction range)")
    if factor is None:
        if max_pos is None:
            raise ConfigError(f"config key '{key}.factor' is missing (required by yarn rope)")
        factor = max_pos / orig
    attention_factor = merged.get("attention_factor")
    if attention_factor is not None:
        attention_factor = _as_float(f"{key}.attention_factor", attention_factor)
    else:
        mscale, mscale_all = merged.get("mscale"), merged.get("mscale_all_dim")
        if mscale and mscale_all:
            def get_mscale(scale, m):
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
            attention_factor = get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all))
    return RopeConfig(
        theta=theta, scaling_type="yarn", factor=factor, original_max_position_embeddings=orig,
        beta_fast=_as_float(f"{key}.beta_fast", merged.get("beta_fast") or 32.0),
        beta_slow=_as_float(f"{key}.beta_slow", merged.get("beta_slow") or 1.0),
        attention_factor=attention_factor,
    )


def _token_ids(key: str, value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return tuple(dict.fromkeys(value))
    raise ConfigError(f"config key {key!r} must be an int or a list of ints, got {value!r}")


def target_config_from_hf(config_dict: Mapping, name_or_path: str = "") -> TargetConfig:
    """Parse a HF `config.json` dict of a supported decoder into a `TargetConfig`."""
    if not isinstance(config_dict, Mapping):
        raise ConfigError(f"a config must be a JSON object, got {type(config_dict).__name__}")
    c = config_dict
    archs = c.get("architectures")
    model_type = c.get("model_type")
    if archs:
        if not isinstance(archs, (list, tuple)) or len(archs) != 1:
            raise ConfigError(f"config key 'architectures' must list exactly one architecture, "
                              f"got {archs!r}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"unsupported architecture: config key 'architectures' = {archs!r}; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    else:
        if model_type not in _ARCH_BY_MODEL_TYPE:
            raise ConfigError(f"unsupported architecture: no 'architectures' and config key "
                              f"'model_type' = {model_type!r}; supported model types: "
                              f"{', '.join(_ARCH_BY_MODEL_TYPE)}")
        arch = _ARCH_BY_MODEL_TYPE[model_type]
    spec = SUPPORTED_ARCHITECTURES[arch]
    if model_type is not None and _MODEL_TYPE_ALIASES.get(model_type, model_type) != spec["model_type"]:
        raise ConfigError(f"config key 'model_type' = {model_type!r} contradicts architecture "
                          f"{arch!r} (expected {spec['model_type']!r})")

    for k in ("text_config", "vision_config"):
        if c.get(k) is not None:
            raise ConfigError(f"config key {k!r} is present: composite (multimodal) configs "
                              "are unsupported; pass the text model's config")
    if c.get("quantization_config") is not None:
        method = c["quantization_config"]
        method = method.get("quant_method", method) if isinstance(method, Mapping) else method
        raise ConfigError(f"config key 'quantization_config' (quant_method {method!r}) is "
                          "unsupported: pre-quantised HF checkpoints cannot be loaded")
    act = c.get("hidden_act", c.get("hidden_activation", "silu"))
    if act != "silu":
        raise ConfigError(f"config key 'hidden_act' = {act!r} is unsupported (only 'silu')")
    if c.get("mlp_bias"):
        raise ConfigError(f"config key 'mlp_bias' = {c['mlp_bias']!r} is unsupported "
                          "(the MLP has no biases)")
    if c.get("use_sliding_window"):
        raise ConfigError(f"config key 'use_sliding_window' = {c['use_sliding_window']!r}: "
                          "sliding-window attention is unsupported")
    if arch == "LlamaForCausalLM" and c.get("sliding_window") is not None:
        raise ConfigError(f"config key 'sliding_window' = {c['sliding_window']!r}: "
                          "sliding-window attention is unsupported")
    layer_types = c.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        bad = sorted({t for t in layer_types if t != "full_attention"})
        raise ConfigError(f"config key 'layer_types' contains {bad}: only 'full_attention' "
                          "layers are supported")
    for k in ("attn_logit_softcapping", "final_logit_softcapping"):
        if c.get(k) is not None:
            raise ConfigError(f"config key {k!r} = {c[k]!r} is unsupported")

    hidden = _positive_int(c, "hidden_size", _require(c, "hidden_size"))
    heads = _positive_int(c, "num_attention_heads", _require(c, "num_attention_heads"))
    kv_heads = c.get("num_key_value_heads", spec["num_key_value_heads"])
    kv_heads = heads if kv_heads is None else _positive_int(c, "num_key_value_heads", kv_heads)
    mla = _mla_config_from_hf(c, heads, kv_heads) if arch == "DeepseekV3ForCausalLM" else None
    head_dim = mla.qk_rope_head_dim if mla is not None else c.get("head_dim", spec["head_dim"])
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"config key 'head_dim' is missing and hidden_size ({hidden}) is "
                              f"not a multiple of num_attention_heads ({heads})")
        head_dim = hidden // heads
    head_dim = _positive_int(c, "head_dim", head_dim)
    if head_dim % 2:
        raise ConfigError(f"config key 'head_dim' = {head_dim} must be even for rotary embeddings")
    max_pos = c.get("max_position_embeddings", spec["max_position_embeddings"])

    attention_bias = bool(c.get("attention_bias", False))
    if mla is not None and attention_bias:
        raise ConfigError("config key 'attention_bias' = True is unsupported for DeepseekV3ForCausalLM "
                          "(MLA projections without biases)")
    if arch == "Qwen2ForCausalLM":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = attention_bias
    eps = c.get("rms_norm_eps", 1e-6)
    num_layers = _positive_int(c, "num_hidden_layers", _require(c, "num_hidden_layers"))
    moe = {"Qwen3MoeForCausalLM": _qwen3_moe_config_from_hf,
           "DeepseekV3ForCausalLM": _deepseek_moe_config_from_hf}.get(arch, lambda c, n: None)(c, num_layers)

    bos = c.get("bos_token_id", spec["bos_token_id"])
    if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):
        raise ConfigError(f"config key 'bos_token_id' must be an int, got {bos!r}")
    try:
        return TargetConfig(
            vocab_size=_positive_int(c, "vocab_size", _require(c, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=_positive_int(c, "intermediate_size", _require(c, "intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=_positive_int(c, "max_position_embeddings", max_pos),
            rms_norm_eps=_as_float("rms_norm_eps", eps),
            rope=rope_config_from_hf(c),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            architecture=arch,
            model_type=spec["model_type"],
            bos_token_id=bos,
            eos_token_ids=_token_ids("eos_token_id", c.get("eos_token_id", spec["eos_token_id"])),
            name_or_path=str(name_or_path or c.get("_name_or_path", "") or ""),
            moe=moe,
            mla=mla,
        )
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"invalid config: {e}") from None


def _flag(config: Mapping, key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
    return value


def _qwen3_moe_config_from_hf(c: Mapping, num_layers: int) -> MoEConfig:
    """Qwen3-MoE's experts: softmax routing; layer i is sparse unless it is in
    `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step` (transformers'
    Qwen3MoeDecoderLayer)."""
    step = _positive_int(c, "decoder_sparse_step", c.get("decoder_sparse_step", 1))
    dense = c.get("mlp_only_layers") or []
    if not isinstance(dense, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ConfigError(f"config key 'mlp_only_layers' must be a list of layer ids, got {dense!r}")
    # transformers 5 writes `num_experts` (the checkpoints' name) as `num_local_experts`
    key = "num_experts" if c.get("num_local_experts") is None else "num_local_experts"
    if c.get("num_experts") is not None and c.get(key) != c["num_experts"]:
        raise ConfigError(f"config keys 'num_experts' ({c['num_experts']!r}) and 'num_local_experts' "
                          f"({c['num_local_experts']!r}) differ")
    return MoEConfig(
        num_experts=_positive_int(c, key, _require(c, key)),
        experts_per_token=_positive_int(c, "num_experts_per_tok", _require(c, "num_experts_per_tok")),
        intermediate_size=_positive_int(c, "moe_intermediate_size", _require(c, "moe_intermediate_size")),
        layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
        scoring="softmax", norm_topk_prob=_flag(c, "norm_topk_prob", False))


def _deepseek_moe_config_from_hf(c: Mapping, num_layers: int) -> MoEConfig:
    """DeepSeek-V3's experts: sigmoid scores with the correction bias, grouped choice
    ("noaux_tc"), shared experts; the first `first_k_dense_replace` layers dense."""
    for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if c.get(key, value) != value:
            raise ConfigError(f"config key {key!r} = {c[key]!r} is unsupported for DeepseekV3ForCausalLM "
                              f"(only {value!r})")
    first_dense = c.get("first_k_dense_replace")
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
        raise ConfigError(f"config key 'first_k_dense_replace' must be a non-negative integer, got {first_dense!r}")
    shared = c.get("n_shared_experts")
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ConfigError(f"config key 'n_shared_experts' must be a non-negative integer, got {shared!r}")
    return MoEConfig(
        num_experts=_positive_int(c, "n_routed_experts", _require(c, "n_routed_experts")),
        experts_per_token=_positive_int(c, "num_experts_per_tok", _require(c, "num_experts_per_tok")),
        intermediate_size=_positive_int(c, "moe_intermediate_size", _require(c, "moe_intermediate_size")),
        layers=tuple(range(first_dense, num_layers)),
        scoring="sigmoid", norm_topk_prob=_flag(c, "norm_topk_prob", True),
        routed_scaling_factor=_as_float("routed_scaling_factor", _require(c, "routed_scaling_factor")),
        num_groups=_positive_int(c, "n_group", _require(c, "n_group")),
        topk_groups=_positive_int(c, "topk_group", _require(c, "topk_group")),
        num_shared_experts=shared)


def _mla_config_from_hf(c: Mapping, heads: int, kv_heads: int) -> MLAConfig:
    """DeepSeek-V3's multi-head latent attention (`q_lora_rank` must be named: null means
    queries straight from the hidden state)."""
    if kv_heads != heads:
        raise ConfigError(f"config key 'num_key_value_heads' ({kv_heads}) must equal num_attention_heads "
                          f"({heads}) for MLA")
    if "q_lora_rank" not in c:
        raise ConfigError("config key 'q_lora_rank' is missing (null: no query low-rank projection)")
    q_lora = c["q_lora_rank"]
    rope = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
    mscale_all_dim = rope.get("mscale_all_dim") or 0.0
    return MLAConfig(
        kv_lora_rank=_positive_int(c, "kv_lora_rank", _require(c, "kv_lora_rank")),
        q_lora_rank=None if q_lora is None else _positive_int(c, "q_lora_rank", q_lora),
        qk_nope_head_dim=_positive_int(c, "qk_nope_head_dim", _require(c, "qk_nope_head_dim")),
        qk_rope_head_dim=_positive_int(c, "qk_rope_head_dim", _require(c, "qk_rope_head_dim")),
        v_head_dim=_positive_int(c, "v_head_dim", _require(c, "v_head_dim")),
        mscale_all_dim=_as_float("rope_scaling.mscale_all_dim", mscale_all_dim),
        rope_interleave=_flag(c, "rope_interleave", True))


# ----------------------------------------------------------------------------- tensors


def expected_hf_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF checkpoint of `cfg` must contain, with its PyTorch shape."""
    H, F, V, D = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    Q, KV = cfg.q_size, cfg.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.per_layer:
            shapes.update(_layer_shapes(cfg, i, p))
            continue
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "self_attn.q_proj.weight"] = (Q, H)
        shapes[p + "self_attn.k_proj.weight"] = (KV, H)
        shapes[p + "self_attn.v_proj.weight"] = (KV, H)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (Q,)
            shapes[p + "self_attn.k_proj.bias"] = (KV,)
            shapes[p + "self_attn.v_proj.bias"] = (KV,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (D,)
            shapes[p + "self_attn.k_norm.weight"] = (D,)
        shapes[p + "self_attn.o_proj.weight"] = (H, Q)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        shapes[p + "mlp.gate_proj.weight"] = (F, H)
        shapes[p + "mlp.up_proj.weight"] = (F, H)
        shapes[p + "mlp.down_proj.weight"] = (H, F)
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def _layer_shapes(cfg: TargetConfig, i: int, p: str) -> dict[str, tuple[int, ...]]:
    """Layer i's tensors (prefix `p`) in a MoE or MLA checkpoint, with their shapes."""
    H, F = cfg.hidden_size, cfg.intermediate_size
    shapes = {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    a = p + "self_attn."
    if cfg.mla is None:
        Q, KV, D = cfg.q_size, cfg.kv_size, cfg.head_dim
        shapes.update({a + "q_proj.weight": (Q, H), a + "k_proj.weight": (KV, H), a + "v_proj.weight": (KV, H),
                       a + "o_proj.weight": (H, Q)})
        if cfg.qkv_bias:
            shapes.update({a + "q_proj.bias": (Q,), a + "k_proj.bias": (KV,), a + "v_proj.bias": (KV,)})
        if cfg.o_bias:
            shapes[a + "o_proj.bias"] = (H,)
        if cfg.qk_norm:
            shapes.update({a + "q_norm.weight": (D,), a + "k_norm.weight": (D,)})
    else:
        m, heads = cfg.mla, cfg.num_heads
        q = heads * m.qk_head_dim
        if m.q_lora_rank is None:
            shapes[a + "q_proj.weight"] = (q, H)
        else:
            shapes.update({a + "q_a_proj.weight": (m.q_lora_rank, H), a + "q_a_layernorm.weight": (m.q_lora_rank,),
                           a + "q_b_proj.weight": (q, m.q_lora_rank)})
        shapes.update({a + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, H),
                       a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
                       a + "kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                       a + "o_proj.weight": (H, heads * m.v_head_dim)})
    mlp = p + "mlp."
    moe = cfg.moe
    if moe is None or i not in moe.layers:
        return {**shapes, **_swiglu_shapes(mlp, H, F)}
    shapes[mlp + "gate.weight"] = (moe.num_experts, H)
    if moe.scoring == "sigmoid":
        shapes[mlp + "gate.e_score_correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        shapes.update(_swiglu_shapes(f"{mlp}experts.{e}.", H, moe.intermediate_size))
    if moe.num_shared_experts:
        shapes.update(_swiglu_shapes(mlp + "shared_experts.", H, moe.shared_intermediate_size))
    return shapes


def _swiglu_shapes(p: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    return {p + "gate_proj.weight": (width, hidden), p + "up_proj.weight": (width, hidden),
            p + "down_proj.weight": (hidden, width)}


def _listing(names, limit: int = 8) -> str:
    names = sorted(names, key=_natural_key)
    text = ", ".join(names[:limit])
    return text + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def params_from_hf_tensors(cfg: TargetConfig, tensors: Mapping, dtype="float32", *,
                           source: str = "", shape_of: Callable[[str], tuple] | None = None,
                           extra_layers: int = 0) -> dict:
    """Check a HF-named state dict against `cfg` and assemble the PARAMS.md pytree.

    `tensors` maps HF names to arrays in PyTorch `[out, in]` layout; it may be
    lazy (memory-mapped files, on-demand dequantisation): each tensor is read
    once. `shape_of(name)` gives a shape without reading the tensor, for the
    up-front check; it defaults to `tensors[name].shape`. The tensors of
    `extra_layers` layers past the last (DeepSeek-V3's multi-token-prediction
    modules, `num_nextn_predict_layers`) are skipped, as transformers and vLLM
    skip them for the main model.
    """
    dt = resolve_dtype(dtype)
    where = f" in {source}" if source else ""
    shape_of = shape_of or (lambda name: tuple(tensors[name].shape))
    expected = expected_hf_shapes(cfg)
    present = set(tensors.keys())

    missing = [k for k in expected if k not in present]
    if missing:
        raise CheckpointError(f"missing tensor(s){where}: {_listing(missing)}")
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in present
    skipped = tuple(f"model.layers.{cfg.num_layers + j}." for j in range(extra_layers))
    extra = [k for k in present - expected.keys()
             if not _HARMLESS_EXTRA.search(k) and not (tied_head and k == "lm_head.weight")
             and not (skipped and k.startswith(skipped))]
    if extra:
        raise CheckpointError(f"unexpected tensor(s){where}: {_listing(extra)} "
                              f"(not used by {cfg.architecture} with this config)")
    for k, shape in expected.items():
        actual = tuple(shape_of(k))
        if actual != shape:
            raise CheckpointError(f"tensor {k!r}{where} has shape {list(actual)}, "
                                  f"expected {list(shape)}")
    if tied_head:
        head = np.asarray(tensors["lm_head.weight"])
        if tuple(head.shape) != expected["model.embed_tokens.weight"] or not np.array_equal(
                head, np.asarray(tensors["model.embed_tokens.weight"])):
            raise CheckpointError(
                f"tensor 'lm_head.weight'{where} differs from 'model.embed_tokens.weight' although "
                "tie_word_embeddings is true; set tie_word_embeddings to false in config.json "
                "if the output projection is meant to be separate")

    if cfg.per_layer:
        return _per_layer_params(cfg, lambda name: np.asarray(tensors[name]), dt)
    L, H, F, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    Q, KV = cfg.q_size, cfg.kv_size

    def stack(shape, fill):
        out = np.empty((L, *shape), dt)
        for i in range(L):
            fill(out[i], f"model.layers.{i}.")
        return jnp.asarray(out)

    def get(name):
        return np.asarray(tensors[name])

    def fill_qkv(o, p):
        o[:, :Q] = get(p + "self_attn.q_proj.weight").T
        o[:, Q:Q + KV] = get(p + "self_attn.k_proj.weight").T
        o[:, Q + KV:] = get(p + "self_attn.v_proj.weight").T

    def fill_bqkv(o, p):
        o[:Q] = get(p + "self_attn.q_proj.bias")
        o[Q:Q + KV] = get(p + "self_attn.k_proj.bias")
        o[Q + KV:] = get(p + "self_attn.v_proj.bias")

    def fill_gate_up(o, p):
        o[:, :F] = get(p + "mlp.gate_proj.weight").T
        o[:, F:] = get(p + "mlp.up_proj.weight").T

    def fill_from(name, transpose=False):
        def fill(o, p):
            a = get(p + name)
            o[...] = a.T if transpose else a
        return fill

    layers = {"attn_norm": stack((H,), fill_from("input_layernorm.weight")),
              "wqkv": stack((H, Q + 2 * KV), fill_qkv)}
    if cfg.qkv_bias:
        layers["bqkv"] = stack((Q + 2 * KV,), fill_bqkv)
    if cfg.qk_norm:
        layers["q_norm"] = stack((D,), fill_from("self_attn.q_norm.weight"))
        layers["k_norm"] = stack((D,), fill_from("self_attn.k_norm.weight"))
    layers["wo"] = stack((Q, H), fill_from("self_attn.o_proj.weight", transpose=True))
    if cfg.o_bias:
        layers["bo"] = stack((H,), fill_from("self_attn.o_proj.bias"))
    layers["mlp_norm"] = stack((H,), fill_from("post_attention_layernorm.weight"))
    layers["w_gate_up"] = stack((H, 2 * F), fill_gate_up)
    layers["w_down"] = stack((F, H), fill_from("mlp.down_proj.weight", transpose=True))

    params = {"embed": jnp.asarray(get("model.embed_tokens.weight").astype(dt)),
              "layers": layers,
              "final_norm": jnp.asarray(get("model.norm.weight").astype(dt))}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(get("lm_head.weight").T.astype(dt))
    return params


def _per_layer_params(cfg: TargetConfig, get: Callable[[str], np.ndarray], dt: np.dtype) -> dict:
    """The PARAMS.md pytree of a MoE or MLA checkpoint (names checked): one dict per layer
    (`models/moe.py`, `models/mla.py`); the router and its bias in float32."""

    def t(name, dtype=dt):  # a [out, in] projection as [in, out]
        return jnp.asarray(get(name).T.astype(dtype))

    def v(name, dtype=dt):
        return jnp.asarray(get(name).astype(dtype))

    def cat(*names):  # projections side by side: [in, out1 + out2 + ...]
        return jnp.asarray(np.concatenate([get(n).T for n in names], axis=1).astype(dt))

    def experts(p, num, *projs):  # [E, in, out of each proj side by side]
        return jnp.asarray(np.stack([np.concatenate([get(f"{p}experts.{e}.{x}.weight").T for x in projs], axis=1)
                                     for e in range(num)]).astype(dt))

    layers = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layer = {"attn_norm": v(p + "input_layernorm.weight"), "mlp_norm": v(p + "post_attention_layernorm.weight")}
        if cfg.mla is None:
            layer["wqkv"] = cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
            if cfg.qkv_bias:
                layer["bqkv"] = jnp.asarray(np.concatenate(
                    [get(a + f"{x}_proj.bias") for x in "qkv"]).astype(dt))
            if cfg.o_bias:
                layer["bo"] = v(a + "o_proj.bias")
            if cfg.qk_norm:
                layer.update(q_norm=v(a + "q_norm.weight"), k_norm=v(a + "k_norm.weight"))
        else:
            q_a = "q_proj.weight" if cfg.mla.q_lora_rank is None else "q_a_proj.weight"
            layer.update(wqkv_a=cat(a + q_a, a + "kv_a_proj_with_mqa.weight"),
                         kv_a_norm=v(a + "kv_a_layernorm.weight"), wkv_b=t(a + "kv_b_proj.weight"))
            if cfg.mla.q_lora_rank is not None:
                layer.update(q_a_norm=v(a + "q_a_layernorm.weight"), wq_b=t(a + "q_b_proj.weight"))
        layer["wo"] = t(a + "o_proj.weight")
        mlp = p + "mlp."
        moe = cfg.moe
        if moe is None or i not in moe.layers:
            layer.update(w_gate_up=cat(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                         w_down=t(mlp + "down_proj.weight"))
        else:
            layer.update(router=t(mlp + "gate.weight", np.float32),
                         experts_gate_up=experts(mlp, moe.num_experts, "gate_proj", "up_proj"),
                         experts_down=experts(mlp, moe.num_experts, "down_proj"))
            if moe.scoring == "sigmoid":
                layer["router_bias"] = v(mlp + "gate.e_score_correction_bias", np.float32)
            if moe.num_shared_experts:
                s = mlp + "shared_experts."
                layer.update(shared_gate_up=cat(s + "gate_proj.weight", s + "up_proj.weight"),
                             shared_down=t(s + "down_proj.weight"))
        layers[i] = layer
    params = {"embed": v("model.embed_tokens.weight"), "layers": layers, "final_norm": v("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = t("lm_head.weight")
    return params


# ----------------------------------------------------------------------------- files


class _ShardedTensors(Mapping):
    """name -> array over several safetensors files (lazy, memory-mapped)."""

    def __init__(self, files: list[SafetensorsFile]):
        self._where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f:
                if name in self._where:
                    raise CheckpointError(f"tensor {name!r} appears in both "
                                          f"{self._where[name].path} and {f.path}")
                self._where[name] = f

    def __getitem__(self, name):
        return self._where[name][name]

    def __contains__(self, name):
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)

    def shape(self, name):
        return self._where[name].shape(name)


def open_hf_safetensors(path: str | os.PathLike) -> _ShardedTensors:
    """Open the (possibly sharded) safetensors weights of a HF model directory."""
    path = os.fspath(path)
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    try:
        if os.path.isfile(index):
            with open(index) as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            shards = sorted(set(weight_map.values()))
            for s in shards:
                if not os.path.isfile(os.path.join(path, s)):
                    raise FileNotFoundError(f"shard {s!r} listed in {index} does not exist")
            tensors = _ShardedTensors([SafetensorsFile(os.path.join(path, s)) for s in shards])
            for name, shard in weight_map.items():
                if name not in tensors:
                    raise CheckpointError(f"missing tensor: {name!r} is listed in {index} but "
                                          f"absent from shard {shard!r}")
            return tensors
        if os.path.isfile(single):
            return _ShardedTensors([SafetensorsFile(single)])
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    others = [f for f in ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt",
                          "consolidated.00.pth") if os.path.exists(os.path.join(path, f))]
    hint = (f" (found {', '.join(others)}: PyTorch pickles are not loaded; re-save with "
            "save_pretrained(..., safe_serialization=True))") if others else ""
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}{hint}")


def read_hf_config(path: str | os.PathLike) -> dict:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(cfg_path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from None


def load_hf_directory(path: str | os.PathLike, dtype="float32") -> tuple[TargetConfig, dict]:
    """Load `config.json` + safetensors weights of a HF model directory.

    Returns `(cfg, params)` with params in `dtype` (float32, bfloat16, float16),
    in the layout of docs/PARAMS.md. Also reads `generation_config.json`'s
    eos ids into `cfg.eos_token_ids`.
    """
    path = os.fspath(path)
    config = read_hf_config(path)
    cfg = target_config_from_hf(config, name_or_path=path)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        try:
            with open(gen_path) as f:
                gen = json.load(f)
            eos = _token_ids("generation_config.eos_token_id", gen.get("eos_token_id"))
        except (json.JSONDecodeError, ConfigError):
            eos = ()
        if eos:
            cfg = dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + eos)))
    tensors = open_hf_safetensors(path)
    mtp = (config.get("num_nextn_predict_layers") or 0) if cfg.mla is not None else 0
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise ConfigError(f"config key 'num_nextn_predict_layers' must be a non-negative integer, got {mtp!r}")
    params = params_from_hf_tensors(cfg, tensors, dtype, source=path, shape_of=tensors.shape, extra_layers=mtp)
    return cfg, params
