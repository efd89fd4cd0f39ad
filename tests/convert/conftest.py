"""Tiny random HF checkpoints (built with transformers) for the converter tests.

``tiny_hf(name)`` (session fixture returning a factory) builds each case once:
it returns ``(directory, torch_reference_model)``; the reference is float32
(for a bf16 checkpoint: the bf16-saved weights upcast to float32 in torch).
Weights, norms and biases are all randomised so that a wrong transpose,
fusion order or missing bias shows up in the logits.
"""

from __future__ import annotations

import pytest

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-5)

CASES = {
    # Llama 3.1-style llama3 rope scaling; a small original context so that the
    # scaled, smoothed and unscaled frequency bands all occur at these head dims.
    "llama3": dict(arch="llama", num_hidden_layers=3, attention_bias=True,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16}),
    "llama_bf16": dict(arch="llama", dtype="bfloat16", tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "qwen2": dict(arch="qwen2", tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen2_sharded": dict(arch="qwen2", max_shard_size="40KB",
                          rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                           "factor": 2.0}),
    "qwen3": dict(arch="qwen3", head_dim=32, num_hidden_layers=3,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # head_dim 32 and original context 32: two frequencies in the smoothed band, so the
    # GGUF loader has to recover llama3 parameters from llama.cpp's rope_freqs divisors.
    "llama3_gguf": dict(arch="llama", num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        tie_word_embeddings=True,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                         "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 32}),
    "qwen3_bias_yarn": dict(arch="qwen3", head_dim=16, attention_bias=True,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                             "factor": 4.0, "original_max_position_embeddings": 16}),
}


def build_tiny_hf(name: str, out_dir: str, seed: int = 0):
    import torch
    import transformers

    spec = dict(CASES[name])
    arch = spec.pop("arch")
    dtype = spec.pop("dtype", "float32")
    shard = spec.pop("max_shard_size", None)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    config = config_cls(**{**COMMON, **spec})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out_dir, **kwargs)
    if dtype != "float32":
        # Reload the saved low-precision weights upcast to float32 by torch (casting the
        # module itself would also round buffers such as rotary inv_freq).
        transformers.logging.set_verbosity_error()
        model = model_cls.from_pretrained(out_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    built: dict = {}

    def get(name: str):
        if name not in built:
            d = str(tmp_path_factory.mktemp(f"tiny_{name}"))
            built[name] = (d, build_tiny_hf(name, d))
        return built[name]

    return get


# HF -> llama.cpp tensor names, written out independently of eagle_jax.convert.gguf.
_GGUF_BLOCK = {"input_layernorm.weight": "attn_norm.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
               "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight"}


def write_gguf(model, path: str, arch: str, *, extra: dict | None = None, drop: tuple = ()):
    """Write a torch HF model as an F32 GGUF the way llama.cpp's converter lays it out:
    `llama` Q/K rows permuted to the interleaved rotary layout, llama3 rope scaling
    as a `rope_freqs` tensor of per-frequency divisors."""
    import math

    import gguf
    import numpy as np

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = dict(c.rope_parameters)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def permute(t, n_head):  # llama.cpp convert_hf_to_gguf.LlamaModel.permute
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    tensors = {}
    for name, t in model.state_dict().items():
        t = t.float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            g = "output.weight"
        else:
            parts = name.split(".")
            g = f"blk.{parts[2]}.{_GGUF_BLOCK['.'.join(parts[3:])]}"
            if arch == "llama" and ("attn_q." in g or "attn_k." in g):
                t = permute(t, c.num_attention_heads if "attn_q." in g else c.num_key_value_heads)
        tensors[g] = np.ascontiguousarray(t, np.float32)
    if rope.get("rope_type") == "llama3":
        inv = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
        f, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        factors = []
        for freq in inv:
            wavelen = 2 * math.pi / freq
            if wavelen < old / hi:
                factors.append(1.0)
            elif wavelen > old / lo:
                factors.append(f)
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                factors.append(1 / ((1 - smooth) / f + smooth))
        tensors["rope_freqs.weight"] = np.asarray(factors, np.float32)
    tensors.update(extra or {})
    for g, t in tensors.items():
        if g not in drop:
            w.add_tensor(g, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def gguf_writer():
    pytest.importorskip("gguf")
    return write_gguf


_TRAINING_ONLY_MODULES = ("openai", "openai.types", "openai.types.chat", "openai.types.completion",
                          "datasets", "hs_connectors")


def _import_speculators_models():
    """Import speculators' model code (`speculators.models`: Eagle3DraftModel, PEagleDraftModel
    and their configs). Its package __init__ also imports training-data helpers (openai,
    datasets, hs_connectors) that the models never use; those are stubbed only while
    importing, when they are not installed."""
    import importlib
    import sys
    import types

    def stub(name):
        m = types.ModuleType(name)
        m.__path__ = []

        def getattr_(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {})

        m.__getattr__ = getattr_
        return m

    added = []
    for name in _TRAINING_ONLY_MODULES:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = stub(name)
            added.append(name)
    try:
        return importlib.import_module("speculators.models")
    finally:
        for name in added:
            sys.modules.pop(name, None)


@pytest.fixture(scope="session")
def speculators_models():
    """vllm-project/speculators' `speculators.models`; a skip outside CI when absent or broken
    (scripts/setup.sh installs it: `pip install --no-deps speculators==0.9.0`)."""
    import importlib.util
    import os

    try:
        if importlib.util.find_spec("speculators") is None:
            raise ImportError("speculators is not installed (scripts/setup.sh installs it)")
        return _import_speculators_models()
    except Exception as e:  # noqa: BLE001 - report any import failure the same way
        if os.environ.get("CI"):
            pytest.fail(f"speculators must import under CI: {type(e).__name__}: {e}")
        pytest.skip(f"speculators' models do not import here: {type(e).__name__}: {e}")
