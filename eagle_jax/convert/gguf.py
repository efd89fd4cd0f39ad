"""GGUF (llama.cpp) files -> `TargetConfig` + the target parameter pytree.

Supported `general.architecture`: `llama` (Llama 2/3.x, SmolLM2, Mistral
without sliding window), `qwen2`, `qwen3`. Every tensor is dequantised to
float32 with `gguf.quants.dequantize` (any type the `gguf` package knows:
F32/F16/BF16, Q4_0/Q4_1/Q5_x/Q8_0, K-quants, ...) and then cast to the
requested dtype, so a quantised file gives a full-precision model whose
weights are exactly the dequantised values.

llama.cpp's converter permutes the rows of the `llama` Q and K projections
(per head: interleaved rotary pairs instead of HF's rotate-half halves); that
is undone here, as transformers' GGUF loader does. `qwen2`/`qwen3` files use
the NeoX rotary layout and are stored unpermuted.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping

import numpy as np

from eagle_jax.config import ConfigError, RopeConfig, TargetConfig
from eagle_jax.convert.hf import CheckpointError, expected_hf_shapes, params_from_hf_tensors

__all__ = ["load_gguf", "read_gguf_config", "gguf_tokenizer_metadata", "GGUF_ARCHITECTURES"]

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_HF_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_TO_GGUF_BLOCK = {v: k for k, v in _BLOCK_NAMES.items()}
_HF_TO_GGUF_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}

# Tokenizer fields too large to return as metadata.
_BIG_TOKENIZER_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                         "tokenizer.ggml.token_type", "tokenizer.ggml.precompiled_charsmap",
                         "tokenizer.huggingface.json")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return None


def gguf_name(hf: str) -> str:
    if hf in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf]
    m = _HF_BLOCK_RE.match(hf)
    return f"blk.{m.group(1)}.{_HF_TO_GGUF_BLOCK[m.group(2)]}"


def _open(path) -> "gguf.GGUFReader":  # noqa: F821
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError/struct errors on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _fields(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in _BIG_TOKENIZER_FIELDS:
            continue
        try:
            value = field.contents()
        except Exception:  # pragma: no cover - exotic field types
            continue
        if isinstance(value, np.generic):
            value = value.item()
        out[key] = value
    return out


def _llama3_factors(theta, head_dim, factor, low, high, orig):
    """llama.cpp's `rope_freqs` divisors for HF llama3 rope scaling."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    div = np.where(wavelen < orig / high, 1.0,
                   np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return div


def _fit_llama3(div: np.ndarray, theta: float, head_dim: int):
    """(factor, low_freq_factor, high_freq_factor, original_context) reproducing `div`, or None.

    The divisors depend on (low, high, original context) only through the band
    edges original/high and original/low, so low is fixed to 1 unless a published
    parameter set (Llama 3.1/3.2/3.3: low 1, high 4, context 8192) matches.
    """
    def ok(params):
        return np.allclose(_llama3_factors(theta, head_dim, *params), div, rtol=1e-4, atol=1e-6)

    factor = float(div.max())
    for rounded in (float(np.round(factor)), float(np.round(factor, 4))):
        if abs(rounded - factor) < 1e-4 * factor:
            factor = rounded
            break
    for low, high, orig in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 2.0, 8192)):
        if ok((factor, low, high, orig)):
            return factor, low, high, orig
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    mid = (div > 1 + 1e-6) & (div < factor * (1 - 1e-6))
    if mid.sum() < 2 or factor <= 1:
        return None
    # smooth s = (orig / wavelen - low) / (high - low), linear in 1 / wavelen
    s = (1.0 / div[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    a, b = np.polyfit(1.0 / wavelen[mid], s, 1)
    if not (a > 0 and b < 0):
        return None
    high = float(np.round(1.0 - 1.0 / b, 6))
    orig = int(round(a * (high - 1.0)))
    if not (orig >= 1 and ok((factor, 1.0, high, orig))):
        return None
    return factor, 1.0, high, orig


def _rope_from_gguf(meta, arch, theta, head_dim, rope_freqs, path) -> RopeConfig:
    pre = f"{arch}.rope.scaling."
    stype = meta.get(pre + "type")
    if rope_freqs is not None:
        if stype not in (None, "none"):
            raise ConfigError(f"{path}: both tensor 'rope_freqs.weight' and metadata "
                              f"{pre + 'type'!r} = {stype!r}; cannot combine them")
        div = np.asarray(rope_freqs, np.float64).reshape(-1)
        if div.shape != (head_dim // 2,):
            raise CheckpointError(f"tensor 'rope_freqs.weight' has shape {list(div.shape)}, "
                                  f"expected [{head_dim // 2}]")
        if np.allclose(div, 1.0):
            return RopeConfig(theta=theta)
        # llama.cpp stores Llama 3.x rope scaling only as these divisors: recover HF
        # llama3 parameters that reproduce them (checked by recomputation).
        found = _fit_llama3(div, theta, head_dim)
        if found is None:
            raise ConfigError(f"{path}: tensor 'rope_freqs.weight' (per-frequency rope divisors) "
                              "does not match llama3 rope scaling with any recoverable parameters")
        factor, low, high, orig = found
        return RopeConfig(theta=theta, scaling_type="llama3", factor=factor, low_freq_factor=low,
                          high_freq_factor=high, original_max_position_embeddings=orig)
    if stype in (None, "none"):
        return RopeConfig(theta=theta)
    neutral = {"attn_factor": (None, 1.0), "yarn_attn_factor": (None, 1.0),
               "yarn_log_multiplier": (None, 0.1)}
    for k, ok in neutral.items():
        if meta.get(pre + k) is not None and not any(
                v is not None and math.isclose(meta[pre + k], v) for v in ok):
            raise ConfigError(f"{path}: metadata {pre + k!r} = {meta[pre + k]!r} is unsupported")
    factor = meta.get(pre + "factor")
    if factor is None:
        raise ConfigError(f"{path}: metadata {pre + 'factor'!r} is missing for rope scaling {stype!r}")
    if stype == "linear":
        return RopeConfig(theta=theta, scaling_type="linear", factor=float(factor))
    if stype == "yarn":
        orig = meta.get(pre + "original_context_length")
        if orig is None:
            raise ConfigError(f"{path}: metadata {pre + 'original_context_length'!r} is missing "
                              "for yarn rope scaling")
        return RopeConfig(theta=theta, scaling_type="yarn", factor=float(factor),
                          original_max_position_embeddings=int(orig),
                          beta_fast=float(meta.get(pre + "yarn_beta_fast", 32.0)),
                          beta_slow=float(meta.get(pre + "yarn_beta_slow", 1.0)))
    raise ConfigError(f"{path}: unsupported rope type: metadata {pre + 'type'!r} = {stype!r}; "
                      "supported: none, linear, yarn (and llama3 via rope_freqs.weight)")


def read_gguf_config(reader, path: str = "") -> tuple[TargetConfig, dict]:
    """(TargetConfig, all scalar metadata) of an open `gguf.GGUFReader`."""
    from gguf.quants import dequantize

    meta = _fields(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"{path}: unsupported architecture: metadata 'general.architecture' = "
                          f"{arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")

    def get(key, default=None, required=False):
        full = f"{arch}.{key}"
        value = meta.get(full, default)
        if value is None and required:
            raise ConfigError(f"{path}: metadata {full!r} is missing")
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ConfigError(f"{path}: metadata {full!r} varies per layer ({value[:8]}...); "
                                  "only uniform layers are supported")
            value = value[0]
        return value

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = get("attention.key_length")
    head_dim = int(head_dim) if head_dim is not None else hidden // heads
    value_len = get("attention.value_length")
    if value_len is not None and int(value_len) != head_dim:
        raise ConfigError(f"{path}: metadata '{arch}.attention.value_length' = {value_len} differs "
                          f"from key_length {head_dim}; unsupported")
    rope_dim = get("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ConfigError(f"{path}: metadata '{arch}.rope.dimension_count' = {rope_dim} is smaller "
                          f"than head_dim {head_dim}: partial rotary embeddings are unsupported")
    for key in ("attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"):
        if get(key) not in (None, 0):
            raise ConfigError(f"{path}: metadata '{arch}.{key}' = {get(key)!r} is unsupported")
    if meta.get("general.type", "model") != "model":
        raise ConfigError(f"{path}: metadata 'general.type' = {meta['general.type']!r}; "
                          "expected a model, not an adapter")

    vocab = get("vocab_size")
    if vocab is None:
        if "token_embd.weight" not in tensors:
            raise CheckpointError(f"missing tensor in {path}: 'token_embd.weight'")
        vocab = int(tensors["token_embd.weight"].shape[1])
    theta = float(get("rope.freq_base", 10000.0))
    rope_freqs = None
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        rope_freqs = dequantize(t.data, t.tensor_type)
    rope = _rope_from_gguf(meta, arch, theta, head_dim, rope_freqs, path)

    has_q_bias = "blk.0.attn_q.bias" in tensors
    has_o_bias = "blk.0.attn_output.bias" in tensors
    if arch == "qwen2":
        qkv_bias, o_bias = True, False
    elif arch == "qwen3":
        qkv_bias = o_bias = has_q_bias
    else:
        qkv_bias, o_bias = has_q_bias, has_o_bias
    eos = tuple(dict.fromkeys(int(meta[k]) for k in (
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if meta.get(k) is not None))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    try:
        cfg = TargetConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", required=True)),
            num_layers=int(get("block_count", required=True)),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(get("context_length", 2048)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope=rope,
            tie_word_embeddings="output.weight" not in tensors,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=arch == "qwen3",
            architecture=GGUF_ARCHITECTURES[arch],
            model_type=arch,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
            name_or_path=os.fspath(path),
        )
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return cfg, meta


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `LlamaModel.permute` on the rows of a Q/K tensor."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _GGUFTensors(Mapping):
    """HF name -> dequantised float32 array in PyTorch [out, in] layout (lazy)."""

    def __init__(self, reader, cfg: TargetConfig, arch: str):
        self._by_hf = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self._by_hf[name] = t
        self._cfg, self._arch = cfg, arch

    def __getitem__(self, name):
        from gguf.quants import dequantize

        t = self._by_hf[name]
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(s) for s in reversed(t.shape)))
        if self._arch == "llama":
            if ".self_attn.q_proj." in name:
                w = _unpermute(w, self._cfg.num_heads)
            elif ".self_attn.k_proj." in name:
                w = _unpermute(w, self._cfg.num_kv_heads)
        return w

    def __contains__(self, name):  # Mapping's default would dequantise the tensor
        return name in self._by_hf

    def __iter__(self):
        return iter(self._by_hf)

    def __len__(self):
        return len(self._by_hf)

    def shape(self, name):
        return tuple(int(s) for s in reversed(self._by_hf[name].shape))


def gguf_tokenizer_metadata(meta: Mapping) -> dict:
    """The scalar `tokenizer.*` fields (ids, model, pre-tokenizer, chat template)."""
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def load_gguf(path: str | os.PathLike, dtype="float32") -> tuple[TargetConfig, dict, dict]:
    """Read a GGUF file: `(cfg, params, tokenizer_metadata)`.

    `params` follow docs/PARAMS.md in `dtype`; `tokenizer_metadata` holds the
    scalar `tokenizer.*` metadata (`tokenizer.chat_template`,
    `tokenizer.ggml.eos_token_id`, ...), not the vocabulary arrays.
    """
    path = os.fspath(path)
    reader = _open(path)
    cfg, meta = read_gguf_config(reader, path)
    arch = meta["general.architecture"]

    known = {t.name for t in reader.tensors}
    unknown = sorted(n for n in known if hf_name(n) is None and n != "rope_freqs.weight")
    if unknown:
        raise CheckpointError(f"unexpected tensor(s) in {path}: {', '.join(unknown[:8])}"
                              + (f", ... ({len(unknown) - 8} more)" if len(unknown) > 8 else "")
                              + f" (not used by {arch} with this config)")
    tensors = _GGUFTensors(reader, cfg, arch)
    expected = expected_hf_shapes(cfg)
    missing = [gguf_name(k) for k in expected if k not in tensors]
    if missing:
        raise CheckpointError(f"missing tensor(s) in {path}: {', '.join(missing[:8])}"
                              + (f", ... ({len(missing) - 8} more)" if len(missing) > 8 else ""))
    extra = [gguf_name(k) for k in tensors if k not in expected]
    if extra:
        raise CheckpointError(f"unexpected tensor(s) in {path}: {', '.join(sorted(extra)[:8])} "
                              f"(not used by {arch} with this config)")
    for k, shape in expected.items():
        actual = tensors.shape(k)
        if actual != shape:
            # GGUF lists dimensions innermost first; report both conventions.
            raise CheckpointError(
                f"tensor {gguf_name(k)!r} in {path} has shape {list(actual)} "
                f"(GGUF ne {list(reversed(actual))}), expected {list(shape)} "
                f"(GGUF ne {list(reversed(shape))})")
    params = params_from_hf_tensors(cfg, tensors, dtype, source=path, shape_of=tensors.shape)
    return cfg, params, gguf_tokenizer_metadata(meta)

