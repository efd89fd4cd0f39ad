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

Conventions decided here (documented so the other converters agree):

* **Aux layer ids** are stored in the vLLM/SafeAILab convention: id i is the
  residual stream *entering* target layer i (HF `hidden_states[i]`). SGLang /
  SpecForge ids mean "output of layer i" and get +1. Which convention a config
  uses is decided, in this order:
    1. `aux_layer_semantics=` argument of `drafter_config_from_dict` (caller override);
    2. an explicit `eagle_aux_layer_semantics` key (top level or in
       `eagle_config`): "sglang" / "specforge" / "output" -> +1;
       "vllm" / "safeailab" / "speculators" / "input" -> unchanged; any other value
       is an error;
    3. otherwise: ids read from `eagle_config` of a SpecForge config
       (architecture `*ForCausalLMEagle3`) are SGLang ids (that is where SGLang
       reads them, adding 1 when it captures); every other location (top-level
       ids, speculators configs, native `LlamaForCausalLM` configs) is vLLM
       convention (that is what vLLM reads, unchanged).
  The ids are then sorted (engines capture them in layer order, so the FC's
  column blocks follow ascending layer order whatever the list order was);
  duplicates are an error. Missing ids default to `target_cfg.default_aux_layers()`.
* **RoPE**: `rope_theta` and `rope_scaling` (or transformers-5 `rope_parameters`)
  are each inherited from the target when the draft config lacks the key; an
  explicit `rope_scaling: null` means no scaling. `max_position_embeddings` is
  raised to the target's.
* **norm_before_residual** defaults to True for speculators configs and False
  for native/SpecForge configs (vLLM's defaults).
* **Validation of unknown keys**: any key of the top level, of `eagle_config` or
  of `transformer_layer_config` that starts with one of `FLAG_PREFIXES`
  (`norm_`, `fc_`, `eagle_`, `aux_`, `num_aux`, `target_`, `draft_`, `use_aux`,
  `speculators_`) must be a known key; any other key closer than 0.85
  (difflib ratio) to a known flag name (e.g. `nrom_output`) is also rejected.
  Flags must be JSON booleans (null = absent).
"""

from __future__ import annotations

import difflib
from typing import Any

from eagle_jax.config import ConfigError, DrafterConfig, RopeConfig, TargetConfig

__all__ = [
    "FLAG_PREFIXES",
    "KNOWN_DRAFTER_KEYS",
    "SPECULATORS_VERSION",
    "detect_config_format",
    "drafter_config_from_dict",
    "is_drafter_config",
    "drafter_config_to_native",
    "drafter_config_to_speculators",
    "rope_from_dict",
    "rope_to_dict",
]

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
_SGLANG_SEMANTICS = ("sglang", "specforge", "output")
_VLLM_SEMANTICS = ("vllm", "safeailab", "speculators", "input")
_SUPPORTED_SPECULATORS_TYPES = ("eagle3",)
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

def rope_from_dict(d: dict, fallback: RopeConfig | None = None) -> RopeConfig:
    """RoPE from HF-style keys (`rope_theta` + `rope_scaling`, or transformers-5
    `rope_parameters`); each missing piece comes from `fallback` (the target's)."""
    fallback = fallback or RopeConfig()
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", d.get("rope_theta", fallback.theta))
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = None if kind in (None, "default") else dict(params)
        return _rope_with_scaling(float(theta), scaling, "rope_parameters")
    theta = float(d["rope_theta"]) if d.get("rope_theta") is not None else fallback.theta
    if "rope_scaling" not in d:
        return RopeConfig(**{**_rope_fields(fallback), "theta": theta})
    return _rope_with_scaling(theta, d["rope_scaling"], "rope_scaling")


def _rope_fields(rope: RopeConfig) -> dict:
    return {f: getattr(rope, f) for f in RopeConfig.__dataclass_fields__}


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
        if key in KNOWN_DRAFTER_KEYS:
            continue
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


def _aux_ids(top: dict, fmt: str, target_cfg: TargetConfig | None,
             semantics: str | None) -> tuple[int, ...]:
    eagle_cfg = top.get("eagle_config") or {}
    top_ids = top.get("eagle_aux_hidden_state_layer_ids")
    nested_ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
    if top_ids and nested_ids and list(top_ids) != list(nested_ids):
        raise ConfigError(
            f"eagle_aux_hidden_state_layer_ids disagree: {list(top_ids)} at the top level, "
            f"{list(nested_ids)} in eagle_config")
    ids, location = (top_ids, "top") if top_ids else (nested_ids, "eagle_config")
    declared = top.get("eagle_aux_layer_semantics", eagle_cfg.get("eagle_aux_layer_semantics"))
    if semantics is None:
        semantics = declared
    if semantics is not None:
        if not isinstance(semantics, str) or semantics.lower() not in _SGLANG_SEMANTICS + _VLLM_SEMANTICS:
            raise ConfigError(
                f"eagle_aux_layer_semantics must be one of {_SGLANG_SEMANTICS + _VLLM_SEMANTICS}, "
                f"got {semantics!r}")
        shift = 1 if semantics.lower() in _SGLANG_SEMANTICS else 0
    else:
        shift = 1 if (fmt == "specforge" and location == "eagle_config") else 0

    n_aux = top.get("num_aux_hidden_states", eagle_cfg.get("num_aux_hidden_states"))
    if n_aux is not None and (isinstance(n_aux, bool) or not isinstance(n_aux, int) or n_aux < 1):
        raise ConfigError(f"num_aux_hidden_states must be a positive integer, got {n_aux!r}")

    if not ids:
        if target_cfg is None:
            raise ConfigError(
                "the drafter config has no eagle_aux_hidden_state_layer_ids; pass target_cfg so "
                "the EAGLE-3 default (2, N//2, N-3) can be used")
        out = tuple(target_cfg.default_aux_layers())
        if n_aux is not None and n_aux != len(out):
            raise ConfigError(
                f"num_aux_hidden_states is {n_aux} but the config has no "
                f"eagle_aux_hidden_state_layer_ids and the default has {len(out)} layers")
        return out
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"eagle_aux_hidden_state_layer_ids must be a list of integers, got {ids!r}")
    if n_aux is not None and n_aux != len(ids):
        raise ConfigError(
            f"eagle_aux_hidden_state_layer_ids has {len(ids)} ids {list(ids)} but "
            f"num_aux_hidden_states is {n_aux}")
    out = tuple(sorted(int(i) + shift for i in ids))
    if len(set(out)) != len(out):
        raise ConfigError(f"eagle_aux_hidden_state_layer_ids has duplicates: {list(ids)}")
    if out[0] < 0:
        raise ConfigError(f"eagle_aux_hidden_state_layer_ids must be >= 0, got {list(ids)}")
    if target_cfg is not None and out[-1] > target_cfg.num_layers:
        raise ConfigError(
            f"eagle_aux_hidden_state_layer_ids {list(ids)} (as inputs of layers: {list(out)}) "
            f"exceed the target's {target_cfg.num_layers} layers")
    return out


# ----------------------------------------------------------------------------- parse

def drafter_config_from_dict(config_dict: dict, target_cfg: TargetConfig | None = None, *,
                             aux_layer_semantics: str | None = None) -> DrafterConfig:
    """Parse a SafeAILab / SpecForge / speculators drafter config.json dict.

    `target_cfg` supplies what drafter configs often omit (aux layer ids, RoPE,
    max length) and is checked against (`vocab_size`, `target_hidden_size`).
    `aux_layer_semantics` ("sglang" or "vllm") overrides the detection of the
    aux id convention (module docstring).
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
        if algo is not None and algo not in _SUPPORTED_SPECULATORS_TYPES:
            raise ConfigError(f"speculators_config.algorithm {algo!r} is not eagle3")
        layer = {**{k: v for k, v in _LLAMA_DEFAULTS.items() if k != "vocab_size"}, **layer}
    else:
        layer, where, spec = top, "the config", {}

    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported for the drafter layer (only "
            "'llama'; a qwen3 layer would carry q_norm/k_norm)")
    n_layers = _int(layer, "num_hidden_layers", where, default=1)
    if n_layers != 1:
        raise ConfigError(f"num_hidden_layers is {n_layers}; an EAGLE-3 drafter has exactly 1 layer")
    act = layer.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if layer.get("mlp_bias"):
        raise ConfigError("mlp_bias: true is not supported by the drafter")
    if top.get("bias"):
        raise ConfigError("bias: true (an FC with bias) is not supported by the drafter")

    hidden = _int(layer, "hidden_size", where)
    heads = _int(layer, "num_attention_heads", where)
    kv_heads = _int(layer, "num_key_value_heads", where, default=heads)
    head_dim = _int(layer, "head_dim", where, default=None)
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
    rope = rope_from_dict(layer, target_cfg.rope if target_cfg is not None else None)
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
    norm_before_residual = _flag(top, layer, "norm_before_residual", fmt == "speculators")

    aux = _aux_ids(top, fmt, target_cfg, aux_layer_semantics)

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
        speculative_tokens=spec_tokens)


# ----------------------------------------------------------------------------- export

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
    if torch_dtype:
        d["torch_dtype"] = torch_dtype
    return d


def drafter_config_to_native(cfg: DrafterConfig, *, torch_dtype: str | None = None) -> dict:
    """A SafeAILab-style config.json dict (LlamaForCausalLM fields + drafter keys).

    Aux ids are written at the top level in the vLLM convention (input of layer
    i), which is what vLLM and this package read from that location.
    """
    d = _layer_dict(cfg, torch_dtype)
    d.update({
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "num_aux_hidden_states": cfg.num_aux,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
    })
    return d


def drafter_config_to_speculators(cfg: DrafterConfig, *, torch_dtype: str | None = None) -> dict:
    """A speculators-format config.json dict (`speculators_model_type: "eagle3"`)."""
    d: dict[str, Any] = {
        "architectures": ["Eagle3DraftModel"],  # what speculators' save_pretrained writes
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _layer_dict(cfg, torch_dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "speculators_config": {
            "algorithm": "eagle3",
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
