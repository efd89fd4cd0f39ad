"""Drafter `config.json` dialects -> `DrafterConfig`, and back.

Three dialects are read (EAGLE.md section 5):

* **SafeAILab native**: a `LlamaForCausalLM`-style dict (`hidden_size`,
  `num_attention_heads`, ..., `num_hidden_layers: 1`, `vocab_size` = the
  target vocabulary) plus `draft_vocab_size` and optionally
  `target_hidden_size`, the flags and `eagle_aux_hidden_state_layer_ids`
  (top level or inside `eagle_config`).
* **SpecForge**: the same fields with architecture `LlamaForCausalLMEagle3`
  (any `*ForCausalLMEagle3`), optional `eagle_config` nesting,
  `num_aux_hidden_states`, `fc_norm` (legacy alias `use_aux_norm`).
* **speculators** (what vLLM serves by path): `speculators_model_type: "eagle3"`,
  the layer fields inside `transformer_layer_config`, the flags and aux ids at
  the top level, `speculators_config.{proposal_methods, verifier}`.

Which publishers write which layout (all parse to the fields vLLM, or the
trainer that wrote the file, derives from it):

    publisher             layout                                  aux ids (if any)
    SafeAILab             native, LlamaForCausalLM                top level, as stored
    SpecForge / SGLang    native keys, *ForCausalLMEagle3,        eagle_config: +1 (SGLang)
    TorchSpec             model_type llama or qwen2               top level: as stored
    AngelSlim             native, Eagle3LlamaForCausalLM          (none: the default)
    speculators, RedHatAI speculators (transformer_layer_config)  top level, as stored

Rules decided here (README "Drafters"; the other converters agree):

* **Aux layer ids** are stored in the vLLM/SafeAILab convention: id i is the
  residual stream *entering* target layer i (HF `hidden_states[i]`). SGLang
  reads `eagle_config.eagle_aux_hidden_state_layer_ids` as "output of layer i"
  and captures i + 1, and SpecForge/TorchSpec trained with SGLang's capture, so
  those ids get +1. The reading is decided, in this order:
    1. `aux_layer_semantics=` argument (the CLI's `--aux-layer-semantics`);
    2. an explicit `eagle_aux_layer_semantics` key (top level or in
       `eagle_config`): "sglang" / "specforge" / "output" -> +1;
       "vllm" / "safeailab" / "speculators" / "input" -> as stored; any other
       value is an error;
    3. otherwise: ids in `eagle_config` of a `*ForCausalLMEagle3` config are
       SGLang ids; every other location (top-level ids, speculators configs,
       native `LlamaForCausalLM` / `Eagle3LlamaForCausalLM` configs) is read as
       stored, as vLLM does.
  The reading applied is logged (logger `eagle_jax.convert`). Ids are sorted
  (engines capture them in layer order); duplicates are an error. A config
  without ids takes the target's default (2, N//2, N-3), which every trainer
  above also uses (SGLang/AngelSlim spell it [1, N//2-1, N-4] as outputs);
  parsed without a target, the ids stay `()` (`num_aux_hidden_states` of them,
  3 by default) until `DrafterConfig.for_target`.
* **RoPE** is the drafter config's own, as vLLM builds the draft layer and the
  trainers (SafeAILab, SpecForge, AngelSlim, speculators) train it: a missing
  `rope_theta` is the Llama/Qwen2 default 10000 and a missing `rope_scaling`
  means none, whatever the target uses. `rope_parameters` (transformers 5) is
  read too. Only `max_position_embeddings` is raised to the target's.
* **Layer family**: `model_type` "llama" or "qwen2" is the Llama EAGLE-3 layer
  vLLM runs for both; biases come from `attention_bias` alone (q/k/v and o; a
  Qwen2 config has no such key, and SpecForge's trainer uses none). "qwen3"
  (q_norm/k_norm) is refused with `UnsupportedDrafterError`.
* **MLA drafters** (vLLM's `Eagle3DeepseekV2ForCausalLM`, the Kimi K2.x drafters
  TorchSpec trains: architecture `Eagle3Deepseek*`, a DeepSeek / Kimi `model_type`
  or `kv_lora_rank`) set `DrafterConfig.mla` (docs/notes/mla-drafter.md). vLLM
  reads the config as a transformers `DeepseekV3Config`, whose class defaults fill
  any absent key, so every field the layer uses must be named: `kv_lora_rank`,
  `q_lora_rank` (null: queries from the 2H input), `qk_nope_head_dim`,
  `qk_rope_head_dim`, `v_head_dim`, `rms_norm_eps` (also the q_a / kv_a norms'),
  `rope_theta`; `rope_scaling` absent or null means none, else it is DeepSeek's YaRN
  with `factor`, `original_max_position_embeddings`, `beta_fast`, `beta_slow`,
  `mscale`, `mscale_all_dim` all named (vLLM runs any `rope_scaling` as
  `deepseek_yarn`: cos/sin times mscale(factor, mscale) / mscale(factor,
  mscale_all_dim), softmax scale times mscale(factor, mscale_all_dim)^2). The rope
  columns are interleaved pairs (vLLM's `is_neox_style=False`). Keys that would
  change that computation otherwise (`rope_interleave` false, another rope type,
  `attention_factor`, `attn_factor` / `extrapolation_factor` other than 1,
  `apply_yarn_scaling` false, DeepSeek-V3.2's `index_topk`, `attention_bias`, a
  sliding layer) are refused; the MoE keys of a DeepSeek config are not read (the
  drafter's MLP is dense, as vLLM builds it). There is no speculators MLA format.
* **Attention window**: the layer is sliding-window iff `layer_types` is
  `["sliding_attention"]` (HF, vLLM and speculators read only that; a Qwen2
  config without `layer_types` derives it as HF does from `use_sliding_window`
  and `max_window_layers`); the window is `sliding_window`. A `sliding_window`
  value without a sliding layer type is ignored, as every engine ignores it.
* **norm_before_residual** defaults to True for speculators `eagle3` configs
  and False for `peagle` and native/SpecForge configs (vLLM's defaults).
* **Parallel drafters (P-EAGLE)** carry a placeholder token id, which sets
  `DrafterConfig.mask_token_id`. A speculators config says
  `speculators_model_type: "peagle"` with a required top-level `mask_token_id`
  (vLLM's `update_peagle` copies it to `pard_token` and serves the drafter as
  eagle3 with `parallel_drafting`). A native / SpecForge config names it
  `pard_token` or `ptd_token_id` (what vLLM's proposer reads, served with
  `"parallel_drafting": true`; newer vLLM also reads `mask_token_id`). Several
  of these keys must agree; a placeholder key in a speculators `eagle3` config
  is an error (vLLM would drop it). Writing, the speculators format repeats
  `fc_norm` and `norm_output` inside `transformer_layer_config`, where vLLM's
  `update_peagle` (which forwards neither) still finds them; `mask_hidden` is
  written [1, 1, A*Ht], the shape speculators' model loads (vLLM views it flat).
* **Keys**: metadata in `IGNORED_METADATA_KEYS` is accepted and ignored; keys
  that change the computation are checked against the values the drafter
  implements (`_IMPLEMENTED_VALUES`); any other key of the top level, of
  `eagle_config` or of `transformer_layer_config` that starts with one of
  `FLAG_PREFIXES` must be a known drafter key, and a key closer than 0.85
  (difflib ratio) to a flag name (e.g. `nrom_output`) is rejected. Flags must
  be JSON booleans (null = absent).
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import logging
import math
from typing import Any

from eagle_jax.config import ConfigError, DrafterConfig, MLAConfig, RopeConfig, TargetConfig

__all__ = [
    "AUX_LAYER_SEMANTICS",
    "aux_layer_semantics_override",
    "FLAG_PREFIXES",
    "IGNORED_METADATA_KEYS",
    "KNOWN_DRAFTER_KEYS",
    "SPECULATORS_VERSION",
    "detect_config_format",
    "drafter_config_from_dict",
    "is_drafter_config",
    "drafter_config_to_native",
    "drafter_config_to_speculators",
    "rope_from_dict",
    "rope_to_dict",
    "UnsupportedDrafterError",
]

log = logging.getLogger("eagle_jax.convert")


class UnsupportedDrafterError(ConfigError):
    """A well-formed drafter config describes a drafter eagle-jax does not implement."""


SPECULATORS_VERSION = "0.9.0"

FLAG_NAMES = ("fc_norm", "norm_before_fc", "norm_before_residual", "norm_output")
FLAG_PREFIXES = ("norm_", "fc_", "eagle_", "aux_", "num_aux", "target_", "draft_", "use_aux",
                 "speculators_")
KNOWN_DRAFTER_KEYS = frozenset(FLAG_NAMES) | {
    "use_aux_norm",  # SpecForge legacy alias of fc_norm
    "eagle_config",
    "eagle_aux_hidden_state_layer_ids",
    "eagle_aux_layer_semantics",
    "use_aux_hidden_state",  # inside eagle_config; must not be false
    "num_aux_hidden_states",
    "target_hidden_size",
    "target_vocab_size",
    "draft_vocab_size",
    "truncated_vocab_size",  # nebius-style alias of draft_vocab_size
    "speculators_model_type",
    "speculators_version",
    "speculators_config",
}
# The P-EAGLE placeholder token id, by the names vLLM reads (module docstring).
PLACEHOLDER_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")
KNOWN_DRAFTER_KEYS = KNOWN_DRAFTER_KEYS | set(PLACEHOLDER_KEYS)
# Published drafter configs carry these; no engine reads them to build the drafter.
IGNORED_METADATA_KEYS = frozenset({
    "torch_dtype", "dtype", "transformers_version", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "attention_dropout",
    "pretraining_tp", "tie_word_embeddings", "embed_requires_grad",
    "target_model_type",  # AngelSlim, SpecForge: the target's family, informational
    # speculators' P-EAGLE training settings (depths trained, COD sampling): no engine reads them
    "para_depths", "down_sample_ratio", "down_sample_ratio_min", "max_anchors", "prediction_loss_weight",
})
_SGLANG_SEMANTICS = ("sglang", "specforge", "output")
_VLLM_SEMANTICS = ("vllm", "safeailab", "speculators", "input")
AUX_LAYER_SEMANTICS = _SGLANG_SEMANTICS + _VLLM_SEMANTICS
_LAYER_FAMILIES = ("llama", "qwen2")  # both run as vLLM's Llama EAGLE-3 layer
_MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")
_MLA_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"  # vLLM's (Eagle3DeepseekV3ForCausalLM is its alias)
# The MLA fields an MLA drafter config must name (module docstring), and its YaRN's.
_MLA_REQUIRED = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "rms_norm_eps", "rope_theta")
_MLA_YARN_REQUIRED = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                      "mscale_all_dim")
# Keys that change what the layer computes, with the values the drafter implements
# (null counts as absent).
_IMPLEMENTED_VALUES = {
    "hidden_act": ("silu", "swish"),
    "mlp_bias": (False,),
    "bias": (False,),  # vLLM: an o_proj bias; SafeAILab EAGLE-1: an FC bias
    "logit_scale": (1, 1.0),
    "partial_rotary_factor": (1, 1.0),
    "is_causal": (True,),
    "attn_logit_softcapping": (),
    # ModelOpt / Megatron eagle_config switches (TorchSpec's Kimi configs carry them): the EAGLE-3 layer's values
    "use_input_layernorm_in_first_layer": (True,),
    "use_last_layernorm": (True,),
    "use_mtp_layernorm": (False,),
}
_SUPPORTED_SPECULATORS_TYPES = ("eagle3", "peagle")
# transformer_layer_config is a serialized LlamaConfig; transformers 4's
# to_diff_dict drops values equal to these class defaults.
_LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                   "num_attention_heads": 32, "max_position_embeddings": 2048}


def _is_specforge(d: dict) -> bool:
    archs = d.get("architectures") or []
    return any(isinstance(a, str) and a.endswith("ForCausalLMEagle3") for a in archs)


def is_drafter_config(config_dict: dict) -> bool:
    """True when a config.json dict looks like an EAGLE-3 drafter (speculators
    eagle3, a `*ForCausalLMEagle3` architecture, or a one-layer Llama config
    with drafter keys such as `draft_vocab_size`)."""
    if not isinstance(config_dict, dict):
        return False
    if "speculators_model_type" in config_dict or _is_specforge(config_dict):
        return True
    drafter_keys = KNOWN_DRAFTER_KEYS - {"speculators_model_type", "speculators_version",
                                         "speculators_config"}
    return config_dict.get("num_hidden_layers") == 1 and any(k in config_dict for k in drafter_keys)


def detect_config_format(config_dict: dict) -> str:
    """"speculators" (has `speculators_model_type`), "specforge"
    (architecture `*ForCausalLMEagle3`) or "native"."""
    if not isinstance(config_dict, dict):
        raise ConfigError(f"a drafter config must be a JSON object, got {type(config_dict).__name__}")
    if "speculators_model_type" in config_dict:
        return "speculators"
    if _is_specforge(config_dict):
        return "specforge"
    return "native"


# ----------------------------------------------------------------------------- rope

def rope_from_dict(d: dict) -> RopeConfig:
    """RoPE from HF-style keys (`rope_theta` + `rope_scaling`, or transformers-5
    `rope_parameters`); a missing theta is the Llama default 10000, a missing
    scaling none."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", d.get("rope_theta", RopeConfig.theta))
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = None if kind in (None, "default") else dict(params)
        return _rope_with_scaling(float(theta), scaling, "rope_parameters")
    theta = float(d["rope_theta"]) if d.get("rope_theta") is not None else RopeConfig.theta
    return _rope_with_scaling(theta, d.get("rope_scaling"), "rope_scaling")


def _rope_with_scaling(theta: float, scaling: dict | None, key: str) -> RopeConfig:
    if scaling is None:
        return RopeConfig(theta=theta)
    if not isinstance(scaling, dict):
        raise ConfigError(f"{key} must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return RopeConfig(theta=theta)
    kw: dict[str, Any] = {"theta": theta, "scaling_type": kind}
    names = {"factor": "factor", "low_freq_factor": "low_freq_factor",
             "high_freq_factor": "high_freq_factor", "beta_fast": "beta_fast",
             "beta_slow": "beta_slow", "attention_factor": "attention_factor",
             "original_max_position_embeddings": "original_max_position_embeddings"}
    for src, dst in names.items():
        if scaling.get(src) is not None:
            kw[dst] = scaling[src]
    if "original_max_position_embeddings" in kw:
        kw["original_max_position_embeddings"] = int(kw["original_max_position_embeddings"])
    try:
        return RopeConfig(**kw)
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None


def rope_to_dict(rope: RopeConfig) -> dict:
    """{"rope_theta": ..., "rope_scaling": None | {...}} in HF 4.x spelling."""
    out: dict[str, Any] = {"rope_theta": float(rope.theta), "rope_scaling": None}
    if rope.scaling_type is None:
        return out
    s: dict[str, Any] = {"rope_type": rope.scaling_type, "factor": float(rope.factor)}
    if rope.scaling_type == "llama3":
        s.update(low_freq_factor=float(rope.low_freq_factor),
                 high_freq_factor=float(rope.high_freq_factor),
                 original_max_position_embeddings=int(rope.original_max_position_embeddings))
    elif rope.scaling_type == "yarn":
        s.update(beta_fast=float(rope.beta_fast), beta_slow=float(rope.beta_slow),
                 original_max_position_embeddings=int(rope.original_max_position_embeddings))
        if rope.attention_factor is not None:
            s["attention_factor"] = float(rope.attention_factor)
    out["rope_scaling"] = s
    return out


# ----------------------------------------------------------------------------- helpers

def _check_keys(d: dict, where: str) -> None:
    for key in d:
        if key in KNOWN_DRAFTER_KEYS or key in IGNORED_METADATA_KEYS:
            continue
        if key in _IMPLEMENTED_VALUES and d[key] is not None and d[key] not in _IMPLEMENTED_VALUES[key]:
            raise UnsupportedDrafterError(f"{key}={d[key]!r} in {where} is not supported by the "
                                          f"drafter (supported: {list(_IMPLEMENTED_VALUES[key])})")
        if key.startswith(FLAG_PREFIXES):
            raise ConfigError(
                f"unknown drafter key {key!r} in {where}; known drafter keys: "
                f"{sorted(k for k in KNOWN_DRAFTER_KEYS if k.startswith(FLAG_PREFIXES))}")
        close = difflib.get_close_matches(key, FLAG_NAMES, n=1, cutoff=0.85)
        if close:
            raise ConfigError(f"unknown key {key!r} in {where}: did you mean {close[0]!r}?")


def _bool(d: dict, key: str, where: str) -> bool | None:
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise ConfigError(f"{key} in {where} must be true or false, got {value!r}")
    return value


def _int(d: dict, key: str, where: str, default: Any = ConfigError) -> int:
    value = d.get(key)
    if value is None:
        if default is ConfigError:
            raise ConfigError(f"{where} lacks required key {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} in {where} must be an integer, got {value!r}")
    return value


def _flag(top: dict, layer: dict, key: str, default: bool, aliases: tuple[str, ...] = ()) -> bool:
    """A flag from the top level, else from the layer dict (speculators), else default."""
    sources = [(top, "the config")]
    if layer is not top:
        sources.append((layer, "transformer_layer_config"))
    values = []
    for name in (key, *aliases):
        for d, where in sources:
            v = _bool(d, name, where)
            if v is not None:
                values.append((name, where, v))
    if not values:
        return default
    if len({v for _, _, v in values}) > 1:
        desc = ", ".join(f"{n}={v} ({w})" for n, w, v in values)
        raise ConfigError(f"conflicting values for {key}: {desc}")
    return values[0][2]


def _aux_shift(top: dict, fmt: str, location: str, semantics: str | None) -> tuple[int, str]:
    """(+1 or 0, the reading's name) for ids found at `location` (module docstring)."""
    eagle_cfg = top.get("eagle_config") or {}
    source = "the caller's override"
    if semantics is None:
        semantics = top.get("eagle_aux_layer_semantics", eagle_cfg.get("eagle_aux_layer_semantics"))
        source = "the config's eagle_aux_layer_semantics"
    if semantics is not None:
        if not isinstance(semantics, str) or semantics.lower() not in AUX_LAYER_SEMANTICS:
            raise ConfigError(f"eagle_aux_layer_semantics must be one of {AUX_LAYER_SEMANTICS}, "
                              f"got {semantics!r}")
        sglang = semantics.lower() in _SGLANG_SEMANTICS
    else:
        sglang = fmt == "specforge" and location == "eagle_config"
        source = f"the rule for {location} ids of a {fmt} config"
    reading = "outputs of layers (SGLang), +1" if sglang else "inputs of layers (vLLM), as stored"
    return int(sglang), f"{reading}, by {source}"


def _aux_ids(top: dict, fmt: str, target_cfg: TargetConfig | None,
             semantics: str | None) -> tuple[tuple[int, ...], int, str]:
    """(aux ids in the vLLM convention or () for the target's default, number of
    aux states, a sentence saying which reading was applied)."""
    eagle_cfg = top.get("eagle_config") or {}
    top_ids = top.get("eagle_aux_hidden_state_layer_ids")
    nested_ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
    if top_ids and nested_ids and list(top_ids) != list(nested_ids):
        raise ConfigError(
            f"eagle_aux_hidden_state_layer_ids disagree: {list(top_ids)} at the top level, "
            f"{list(nested_ids)} in eagle_config")
    ids, location = (top_ids, "top-level") if top_ids else (nested_ids, "eagle_config")
    n_aux = top.get("num_aux_hidden_states", eagle_cfg.get("num_aux_hidden_states"))
    if n_aux is not None and (isinstance(n_aux, bool) or not isinstance(n_aux, int) or n_aux < 1):
        raise ConfigError(f"num_aux_hidden_states must be a positive integer, got {n_aux!r}")

    if not ids:
        if target_cfg is None:
            n = 3 if n_aux is None else n_aux
            return (), n, f"no aux ids: the default of the target it runs with ({n} states)"
        out = tuple(target_cfg.default_aux_layers())
        if n_aux is not None and n_aux != len(out):
            raise ConfigError(
                f"num_aux_hidden_states is {n_aux} but the config has no "
                f"eagle_aux_hidden_state_layer_ids and the default has {len(out)} layers")
        return out, len(out), f"no aux ids: the EAGLE-3 default, inputs of layers {list(out)}"
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"eagle_aux_hidden_state_layer_ids must be a list of integers, got {ids!r}")
    if n_aux is not None and n_aux != len(ids):
        raise ConfigError(
            f"eagle_aux_hidden_state_layer_ids has {len(ids)} ids {list(ids)} but "
            f"num_aux_hidden_states is {n_aux}")
    shift, reading = _aux_shift(top, fmt, location, semantics)
    out = tuple(sorted(int(i) + shift for i in ids))
    if len(set(out)) != len(out):
        raise ConfigError(f"eagle_aux_hidden_state_layer_ids has duplicates: {list(ids)}")
    if out[0] < 0:
        raise ConfigError(f"eagle_aux_hidden_state_layer_ids must be >= 0, got {list(ids)}")
    if target_cfg is not None and out[-1] > target_cfg.num_layers:
        raise ConfigError(
            f"eagle_aux_hidden_state_layer_ids {list(ids)} (as inputs of layers: {list(out)}) "
            f"exceed the target's {target_cfg.num_layers} layers")
    return out, len(out), f"{location} aux ids {list(ids)} read as {reading}: inputs of layers {list(out)}"


def _layer_family(top: dict, layer: dict, where: str) -> str:
    """The drafter layer's family: its model_type ("llama", "qwen2"), or "mla" (module
    docstring), refusing the families the drafter does not implement."""
    model_type = layer.get("model_type", "llama")
    archs = [a for a in (top.get("architectures") or []) if isinstance(a, str)]
    if (any(layer.get(k) is not None for k in _MLA_KEYS) or model_type in _MLA_TYPES
            or any("Deepseek" in a for a in archs)):
        return "mla"
    if model_type == "qwen3":
        raise UnsupportedDrafterError(
            f"{where}: a qwen3 drafter layer (per-head q_norm/k_norm) is not supported; "
            f"supported model_type: {list(_LAYER_FAMILIES)}")
    if model_type not in _LAYER_FAMILIES:
        raise UnsupportedDrafterError(f"{where}: model_type {model_type!r} is not supported for the "
                                      f"drafter layer; supported: {list(_LAYER_FAMILIES)}")
    return model_type


def _attention_window(layer: dict, model_type: str, where: str) -> int | None:
    """The layer's sliding window, or None for full attention (module docstring)."""
    types = layer.get("layer_types")
    if model_type == "mla":
        if types is not None and types != ["full_attention"]:
            raise UnsupportedDrafterError(f"layer_types {types!r} in {where}: vLLM's MLA drafter layer attends "
                                          "over the whole context (full_attention)")
        return None
    if types is None and model_type == "qwen2":
        sliding = bool(layer.get("use_sliding_window")) and _int(
            layer, "max_window_layers", where, default=28) <= 0
        types = ["sliding_attention" if sliding else "full_attention"]
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != 1:
        raise ConfigError(f"layer_types in {where} must list the one drafter layer, got {types!r}")
    if types[0] == "full_attention":
        return None
    if types[0] != "sliding_attention":
        raise UnsupportedDrafterError(f"layer_types {types!r} in {where}: only full_attention and "
                                      "sliding_attention layers are supported")
    window = _int(layer, "sliding_window", where, default=None)
    if window is None or window < 1:
        raise ConfigError(f"{where} has a sliding_attention layer but sliding_window is {window!r}")
    return window


def _yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude scale (vLLM's and transformers' `yarn_get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    return float(value)


def _mla_from_dict(layer: dict, where: str) -> tuple[MLAConfig, RopeConfig]:
    """An MLA drafter's attention and RoPE, as vLLM's Eagle3 DeepSeek layer builds them
    (module docstring): every field named, nothing else that would change them."""
    missing = [k for k in _MLA_REQUIRED if k not in layer]
    if missing:
        raise ConfigError(f"{where} lacks {missing}: an MLA drafter config names them (vLLM would take "
                          "DeepseekV3Config's defaults)")
    for key, why in (("index_topk", "DeepSeek-V3.2's sparse-attention indexer"),
                     ("attention_bias", "biases on the MLA projections")):
        if layer.get(key):
            raise UnsupportedDrafterError(f"{key}={layer[key]!r} in {where}: {why} is not supported")
    if layer.get("rope_interleave", True) is not True:
        raise UnsupportedDrafterError(f"rope_interleave={layer['rope_interleave']!r} in {where}: vLLM's MLA "
                                      "drafter layer rotates interleaved pairs (is_neox_style=False)")
    eps = _number(layer["rms_norm_eps"], f"rms_norm_eps in {where}")
    q_lora = layer["q_lora_rank"]
    scaling = {}
    for key in ("rope_scaling", "rope_parameters"):  # transformers 5 writes rope_parameters
        value = layer.get(key)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{key} in {where} must be an object or null, got {value!r}")
        scaling.update(value or {})
    theta = _number(scaling.get("rope_theta", layer["rope_theta"]), f"rope_theta in {where}")
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    mscale_all_dim, rope = 0.0, RopeConfig(theta=theta)
    if kind != "default":
        if kind != "yarn":
            raise UnsupportedDrafterError(f"rope type {kind!r} in {where}: vLLM runs an MLA drafter's "
                                          "rope_scaling as DeepSeek YaRN whatever its type; only yarn is supported")
        missing = [k for k in _MLA_YARN_REQUIRED if scaling.get(k) is None]
        if missing:
            raise ConfigError(f"the YaRN rope_scaling in {where} lacks {missing}")
        for key in ("attn_factor", "extrapolation_factor"):
            if scaling.get(key, 1) != 1:
                raise UnsupportedDrafterError(f"rope_scaling.{key}={scaling[key]!r} in {where} is not supported")
        if scaling.get("attention_factor") is not None or scaling.get("apply_yarn_scaling", True) is not True:
            raise UnsupportedDrafterError(f"rope_scaling in {where}: attention_factor and apply_yarn_scaling "
                                          "false are not DeepSeek YaRN (mscale, mscale_all_dim)")
        factor, mscale, mscale_all_dim, beta_fast, beta_slow = (
            _number(scaling[k], f"rope_scaling.{k} in {where}")
            for k in ("factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"))
        try:
            rope = RopeConfig(
                theta=theta, scaling_type="yarn", factor=factor,
                original_max_position_embeddings=_int(scaling, "original_max_position_embeddings", "rope_scaling"),
                beta_fast=beta_fast, beta_slow=beta_slow,
                attention_factor=_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        except ConfigError as e:
            raise ConfigError(f"rope_scaling in {where}: {e}") from None
    mla = MLAConfig(kv_lora_rank=_int(layer, "kv_lora_rank", where),
                    q_lora_rank=None if q_lora is None else _int(layer, "q_lora_rank", where),
                    qk_nope_head_dim=_int(layer, "qk_nope_head_dim", where),
                    qk_rope_head_dim=_int(layer, "qk_rope_head_dim", where),
                    v_head_dim=_int(layer, "v_head_dim", where), mscale_all_dim=mscale_all_dim, norm_eps=eps)
    return mla, rope


# ----------------------------------------------------------------------------- parse

_SEMANTICS_OVERRIDE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "aux_layer_semantics", default=None)


@contextlib.contextmanager
def aux_layer_semantics_override(semantics: str | None):
    """Inside the block every drafter config is parsed with this aux id reading
    (the CLI's `--aux-layer-semantics`, reaching loads it does not call directly)."""
    if semantics is not None and semantics.lower() not in AUX_LAYER_SEMANTICS:
        raise ConfigError(f"aux layer semantics must be one of {AUX_LAYER_SEMANTICS}, got {semantics!r}")
    token = _SEMANTICS_OVERRIDE.set(semantics)
    try:
        yield
    finally:
        _SEMANTICS_OVERRIDE.reset(token)


def drafter_config_from_dict(config_dict: dict, target_cfg: TargetConfig | None = None, *,
                             aux_layer_semantics: str | None = None) -> DrafterConfig:
    """Parse a SafeAILab / SpecForge / speculators drafter config.json dict.

    `target_cfg` supplies the default aux layer ids and the max length, and is
    checked against (`vocab_size`, `target_hidden_size`); without it a config
    that names no aux ids parses to `aux_layer_ids=()` (see
    `DrafterConfig.for_target`). RoPE is always the drafter config's own.
    `aux_layer_semantics` (one of `AUX_LAYER_SEMANTICS`) overrides the
    reading of the aux ids (module docstring); the reading applied is logged.
    """
    fmt = detect_config_format(config_dict)
    top = config_dict
    _check_keys(top, "the config")
    eagle_cfg = top.get("eagle_config")
    if eagle_cfg is not None:
        if not isinstance(eagle_cfg, dict):
            raise ConfigError(f"eagle_config must be an object, got {eagle_cfg!r}")
        _check_keys(eagle_cfg, "eagle_config")
        if eagle_cfg.get("use_aux_hidden_state") is False:
            raise ConfigError("eagle_config.use_aux_hidden_state is false: that is an EAGLE-1/2 "
                              "drafter, not EAGLE-3")

    if fmt == "speculators":
        mtype = top.get("speculators_model_type")
        if mtype not in _SUPPORTED_SPECULATORS_TYPES:
            raise ConfigError(f"unknown speculators_model_type {mtype!r}; supported: "
                              f"{list(_SUPPORTED_SPECULATORS_TYPES)}")
        layer = top.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ConfigError("a speculators config needs a transformer_layer_config object")
        _check_keys(layer, "transformer_layer_config")
        where = "transformer_layer_config"
        spec = top.get("speculators_config") or {}
        if not isinstance(spec, dict):
            raise ConfigError(f"speculators_config must be an object, got {spec!r}")
        algo = spec.get("algorithm")
        if algo is not None and algo != mtype:
            raise ConfigError(f"speculators_config.algorithm {algo!r} is not the speculators_model_type {mtype!r}")
        layer = {**{k: v for k, v in _LLAMA_DEFAULTS.items() if k != "vocab_size"}, **layer}
    else:
        layer, where, spec = top, "the config", {}

    model_type = _layer_family(top, layer, where)
    if model_type == "mla" and fmt == "speculators":
        raise UnsupportedDrafterError("a speculators config describes a Llama-style layer; an MLA drafter's "
                                      f"config is a DeepSeek one (architecture {MLA_ARCHITECTURE})")
    mla = _mla_from_dict(layer, where) if model_type == "mla" else None
    n_layers = _int(layer, "num_hidden_layers", where, default=1)
    if n_layers != 1:
        raise UnsupportedDrafterError(
            f"num_hidden_layers is {n_layers}; an EAGLE-3 drafter has exactly 1 layer")

    hidden = _int(layer, "hidden_size", where)
    heads = _int(layer, "num_attention_heads", where)
    kv_heads = _int(layer, "num_key_value_heads", where, default=heads)
    head_dim = _int(layer, "head_dim", where, default=None)
    if mla is not None:  # vLLM's MLA layer reads no head_dim: the rotary dim, every head its own KV
        if kv_heads != heads:
            raise ConfigError(f"num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads}) for MLA")
        head_dim = mla[0].qk_rope_head_dim
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}; "
                              "give head_dim")
        head_dim = hidden // heads
    vocab = _int(layer, "vocab_size", where, default=None)
    if top.get("target_vocab_size") is not None:
        tv = _int(top, "target_vocab_size", "the config")
        if vocab is not None and tv != vocab:
            raise ConfigError(f"target_vocab_size {tv} != vocab_size {vocab}")
        vocab = tv
    if vocab is None:
        if target_cfg is not None:
            vocab = target_cfg.vocab_size
        elif fmt == "speculators":
            vocab = _LLAMA_DEFAULTS["vocab_size"]
        else:
            raise ConfigError(f"{where} lacks required key 'vocab_size'")
    if target_cfg is not None and vocab != target_cfg.vocab_size:
        raise ConfigError(f"vocab_size {vocab} of the drafter differs from the target's "
                          f"{target_cfg.vocab_size}")
    draft_vocab = _int(top, "draft_vocab_size", "the config", default=None)
    truncated = _int(top, "truncated_vocab_size", "the config", default=None)
    if draft_vocab is not None and truncated is not None and draft_vocab != truncated:
        raise ConfigError(f"draft_vocab_size {draft_vocab} != truncated_vocab_size {truncated}")
    draft_vocab = draft_vocab if draft_vocab is not None else (truncated if truncated is not None else vocab)
    target_hidden = _int(top, "target_hidden_size", "the config", default=None)
    if target_hidden is None:
        target_hidden = hidden
        if target_cfg is not None and target_cfg.hidden_size != hidden:
            raise ConfigError(
                f"target_hidden_size is absent (so it is hidden_size={hidden}) but the target's "
                f"hidden size is {target_cfg.hidden_size}")
    elif target_cfg is not None and target_cfg.hidden_size != target_hidden:
        raise ConfigError(f"target_hidden_size {target_hidden} differs from the target's hidden "
                          f"size {target_cfg.hidden_size}")

    eps = layer.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise ConfigError(f"rms_norm_eps must be a positive number, got {eps!r}")
    rope = rope_from_dict(layer) if mla is None else mla[1]
    max_pos = _int(layer, "max_position_embeddings", where, default=2048)
    if target_cfg is not None:
        max_pos = max(max_pos, target_cfg.max_position_embeddings)
    attention_bias = bool(layer.get("attention_bias", False))

    fc_norm = _flag(top, layer, "fc_norm", False, aliases=("use_aux_norm",))
    norm_before_fc = _flag(top, layer, "norm_before_fc", False)
    if fc_norm and norm_before_fc:
        raise ConfigError("fc_norm and norm_before_fc are both set; they are mutually exclusive "
                          "(fc_norm normalises each aux state, norm_before_fc the concatenation)")
    norm_output = _flag(top, layer, "norm_output", False)
    mask_token_id = _placeholder(top, fmt)
    norm_before_residual = _flag(top, layer, "norm_before_residual",
                                 fmt == "speculators" and mask_token_id is None)

    aux, n_aux, reading = _aux_ids(top, fmt, target_cfg,
                                   aux_layer_semantics or _SEMANTICS_OVERRIDE.get())
    log.info("drafter config (%s): %s", fmt, reading)

    verifier = spec.get("verifier") or {}
    verifier_name = verifier.get("name_or_path") or (target_cfg.name_or_path if target_cfg else "")
    verifier_archs = verifier.get("architectures") or []
    verifier_arch = (verifier_archs[0] if verifier_archs else
                     (target_cfg.architecture if target_cfg else "LlamaForCausalLM"))
    spec_tokens = 3
    methods = spec.get("proposal_methods") or []
    if methods and isinstance(methods[0], dict) and methods[0].get("speculative_tokens") is not None:
        spec_tokens = int(methods[0]["speculative_tokens"])

    return DrafterConfig(
        hidden_size=hidden, intermediate_size=_int(layer, "intermediate_size", where),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
        draft_vocab_size=draft_vocab, target_hidden_size=target_hidden, aux_layer_ids=aux,
        rms_norm_eps=float(eps), rope=rope, max_position_embeddings=max_pos,
        fc_norm=fc_norm, norm_before_fc=norm_before_fc,
        norm_before_residual=norm_before_residual, norm_output=norm_output,
        qkv_bias=attention_bias, o_bias=attention_bias, has_embedding=False,
        verifier_name_or_path=str(verifier_name or ""), verifier_architecture=str(verifier_arch),
        speculative_tokens=spec_tokens, sliding_window=_attention_window(layer, model_type, where),
        num_aux_states=n_aux, mask_token_id=mask_token_id, mla=None if mla is None else mla[0])


def _placeholder(top: dict, fmt: str) -> int | None:
    """The P-EAGLE placeholder token id of a config, or None for a sequential drafter (module docstring)."""
    found = {k: _int(top, k, "the config", default=None) for k in PLACEHOLDER_KEYS}
    found = {k: v for k, v in found.items() if v is not None}
    peagle = fmt == "speculators" and top.get("speculators_model_type") == "peagle"
    if peagle and "mask_token_id" not in found:
        raise ConfigError("a speculators peagle config needs mask_token_id (the placeholder token id)")
    if fmt == "speculators" and not peagle and found:
        raise ConfigError(f"{sorted(found)} in a speculators eagle3 config: a parallel drafter's config "
                          "says speculators_model_type \"peagle\"")
    if len(set(found.values())) > 1:
        raise ConfigError(f"the placeholder token ids disagree: {found}")
    return next(iter(found.values()), None)  # DrafterConfig checks it against the vocabulary


# ----------------------------------------------------------------------------- export

def _mla_layer_dict(cfg: DrafterConfig) -> dict:
    """The DeepSeek layer fields of an MLA drafter, as `_mla_from_dict` reads them back."""
    m, rope = cfg.mla, cfg.rope
    if m.norm_eps != cfg.rms_norm_eps or not m.rope_interleave:
        raise ConfigError("a DeepSeek drafter config expresses only q_a/kv_a norms with rms_norm_eps and "
                          f"interleaved rope columns; this drafter has norm_eps {m.norm_eps}, rms_norm_eps "
                          f"{cfg.rms_norm_eps}, rope_interleave {m.rope_interleave}")
    d: dict[str, Any] = {
        "architectures": [MLA_ARCHITECTURE], "model_type": "deepseek_v3",
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim,
        "rope_theta": float(rope.theta), "rope_scaling": None,
    }
    if rope.scaling_type is None:  # (then mscale_all_dim has no effect)
        return d
    if rope.scaling_type != "yarn":
        raise ConfigError(f"an MLA drafter's rope is DeepSeek YaRN or none, got {rope.scaling_type!r}")
    # cos/sin scale = mscale(f, mscale) / mscale(f, mscale_all_dim): solve for mscale
    f, msad = rope.factor, m.mscale_all_dim
    scale = rope.attention_factor if rope.attention_factor is not None else _yarn_mscale(f, 1.0)
    if scale == 1.0 or f <= 1:
        if scale != 1.0:
            raise ConfigError(f"a YaRN factor of {f} scales cos/sin by 1, not {scale}")
        mscale = msad
    else:
        mscale = (scale * _yarn_mscale(f, msad) - 1.0) / (0.1 * math.log(f))
    d["rope_scaling"] = {"type": "yarn", "factor": float(f),
                         "original_max_position_embeddings": rope.original_max_position_embeddings,
                         "beta_fast": float(rope.beta_fast), "beta_slow": float(rope.beta_slow),
                         "mscale": float(mscale), "mscale_all_dim": float(msad)}
    return d


def _layer_dict(cfg: DrafterConfig, torch_dtype: str | None) -> dict:
    if cfg.qkv_bias != cfg.o_bias:
        raise ConfigError("a Llama-style config can only express qkv_bias == o_bias "
                          "(attention_bias); this drafter has "
                          f"qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias}")
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        **rope_to_dict(cfg.rope),
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    if cfg.mla is not None:
        d.update(_mla_layer_dict(cfg))
        del d["head_dim"]  # vLLM's MLA layer reads none (it is qk_rope_head_dim)
    if cfg.sliding_window is not None:
        d.update(sliding_window=cfg.sliding_window, layer_types=["sliding_attention"])
    if torch_dtype:
        d["torch_dtype"] = torch_dtype
    return d


def _aux_ids_entry(cfg: DrafterConfig) -> dict:
    """The ids key, absent when they are the target's default (`()`)."""
    return {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)} if cfg.aux_layer_ids else {}


def drafter_config_to_native(cfg: DrafterConfig, *, torch_dtype: str | None = None) -> dict:
    """A SafeAILab-style config.json dict (LlamaForCausalLM fields + drafter keys).

    Aux ids are written at the top level in the vLLM convention (input of layer
    i), which is what vLLM and this package read from that location. A parallel
    drafter's placeholder is `pard_token`, which every vLLM with parallel drafting reads.
    """
    d = _layer_dict(cfg, torch_dtype)
    d.update({
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "num_aux_hidden_states": cfg.num_aux,
        **_aux_ids_entry(cfg),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
    })
    if cfg.parallel_drafting:
        d["pard_token"] = cfg.mask_token_id
    return d


def drafter_config_to_speculators(cfg: DrafterConfig, *, torch_dtype: str | None = None) -> dict:
    """A speculators-format config.json dict: `speculators_model_type` "eagle3", or "peagle"
    with `mask_token_id` for a parallel drafter (module docstring)."""
    if cfg.mla is not None:
        raise ConfigError("speculators has no MLA drafter format: save an MLA drafter in the native format "
                          f"({MLA_ARCHITECTURE})")
    mtype = "peagle" if cfg.parallel_drafting else "eagle3"
    layer = _layer_dict(cfg, torch_dtype)
    if cfg.parallel_drafting:
        layer.update(fc_norm=cfg.fc_norm, norm_output=cfg.norm_output)
    d: dict[str, Any] = {
        # what speculators' save_pretrained writes
        "architectures": ["PEagleDraftModel" if cfg.parallel_drafting else "Eagle3DraftModel"],
        "speculators_model_type": mtype,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        **_aux_ids_entry(cfg),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        **({"mask_token_id": cfg.mask_token_id} if cfg.parallel_drafting else {}),
        "speculators_config": {
            "algorithm": mtype,
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": cfg.speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": cfg.verifier_name_or_path or None,
                         "architectures": [cfg.verifier_architecture]},
        },
    }
    if torch_dtype:
        d["torch_dtype"] = torch_dtype
    return d
