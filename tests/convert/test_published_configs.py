"""Drafter configs in the layouts their publishers write, parsed to what vLLM (or
the trainer that wrote them) derives: RoPE, aux ids, draft vocab, heads,
head_dim, biases, attention window. One section per class of issue 17; the
dicts are written here in each publisher's layout (field sets as they ship:
SafeAILab's Llama-3.1 template, SpecForge / TorchSpec `*ForCausalLMEagle3`,
AngelSlim's `Eagle3LlamaForCausalLM` with metadata, speculators / RedHatAI).

The sliding-window drafter is checked against brute force: a query's output
with a window W equals the full-attention output over only its last W
positions (one layer, so nothing else reaches it).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.config import ConfigError, DrafterConfig, RopeConfig, TargetConfig
from eagle_jax.convert.drafter_config import (
    IGNORED_METADATA_KEYS,
    UnsupportedDrafterError,
    aux_layer_semantics_override,
    drafter_config_from_dict,
    drafter_config_to_native,
    drafter_config_to_speculators,
)
from eagle_jax.models import drafter

LLAMA31_ROPE = RopeConfig(theta=500000.0, scaling_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)


def _target(**kw) -> TargetConfig:
    base = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
                rope=LLAMA31_ROPE, name_or_path="meta-llama/Llama-3.1-8B-Instruct")
    base.update(kw)
    return TargetConfig(**base)


QWEN_TARGET = dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
                   num_heads=40, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
                   rope=RopeConfig(theta=1000000.0), qkv_bias=True, name_or_path="Qwen/QwQ-32B")


def safeailab_llama31() -> dict:
    """SafeAILab's EAGLE-3 template for Llama-3.1-8B-Instruct: no RoPE keys at all."""
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": 128001,
            "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
            "intermediate_size": 14336, "max_position_embeddings": 2048, "model_type": "llama",
            "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 1,
            "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
            "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
            "vocab_size": 128256, "draft_vocab_size": 32000}


def specforge_llama(**extra) -> dict:
    """A SpecForge export for a Llama target: aux ids (SGLang outputs) inside eagle_config."""
    d = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
         "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
         "num_key_value_heads": 8, "num_hidden_layers": 1, "rms_norm_eps": 1e-05,
         "max_position_embeddings": 2048, "vocab_size": 128256, "draft_vocab_size": 32000,
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28], "use_aux_hidden_state": True},
         "torch_dtype": "bfloat16", "tie_word_embeddings": False, "pad_token_id": 0}
    d.update(extra)
    return d


def angelslim_qwen3_8b() -> dict:
    """AngelSlim's drafter for Qwen3-8B: vLLM's architecture name, metadata keys."""
    return {"architectures": ["Eagle3LlamaForCausalLM"], "model_type": "llama",
            "target_model_type": "qwen3", "torch_dtype": "bfloat16", "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
            "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
            "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
            "num_attention_heads": 32, "num_hidden_layers": 1, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
            "sliding_window": None, "tie_word_embeddings": False, "transformers_version": "4.51.0",
            "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
            "draft_vocab_size": 32000}


def specforge_qwq(**extra) -> dict:
    """SpecForge's QwQ-32B drafter: a qwen2 layer config under the Llama EAGLE-3 architecture."""
    d = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "qwen2", "attention_dropout": 0.0,
         "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 5120,
         "initializer_range": 0.02, "intermediate_size": 27648, "max_position_embeddings": 40960,
         "max_window_layers": 64, "num_attention_heads": 40, "num_hidden_layers": 1,
         "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
         "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False,
         "vocab_size": 152064, "draft_vocab_size": 32000, "target_model_type": "qwen2"}
    d.update(extra)
    return d


def speculators_llama(layer_extra=None, **extra) -> dict:
    """A speculators-format (RedHatAI-style) EAGLE-3 drafter for Llama-3.1-8B."""
    layer = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
             "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 1,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
             "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192},
             "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
    layer.update(layer_extra or {})
    d = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
         "speculators_version": "0.3.0", "transformer_layer_config": layer, "draft_vocab_size": 32000,
         "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": [2, 16, 29],
         "norm_before_residual": True, "embed_requires_grad": False,
         "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                "proposal_methods": [{"proposal_type": "greedy",
                                                      "speculative_tokens": 3}],
                                "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
                                             "architectures": ["LlamaForCausalLM"]}},
         "torch_dtype": "bfloat16"}
    d.update(extra)
    return d


def torchspec_kimi_mla() -> dict:
    """TorchSpec's Kimi K2.x EAGLE-3 drafter: MLA attention (DeepSeek-V2 layer)."""
    return {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2",
            "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 1,
            "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-05, "vocab_size": 163840,
            "draft_vocab_size": 163840, "rope_theta": 50000.0,
            "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "max_position_embeddings": 131072,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 30, 57],
                             "use_aux_hidden_state": True}}


# ----------------------------------------------------------------------------- 1. RoPE

def test_missing_rope_keys_mean_the_llama_default_not_the_targets():
    """SafeAILab's template and SpecForge exports without RoPE keys run at theta 10000 with
    no scaling, as vLLM builds the draft layer and as SafeAILab's trainer trained it."""
    target = _target()
    for d in (safeailab_llama31(), specforge_llama()):
        c = drafter_config_from_dict(d, target)
        assert c.rope == RopeConfig(theta=10000.0) and c.rope != target.rope
        assert c.max_position_embeddings == 131072  # raised to the target's; positions unaffected
        assert (c.num_heads, c.num_kv_heads, c.head_dim, c.draft_vocab_size) == (32, 8, 128, 32000)
        assert not c.qkv_bias and not c.o_bias and c.sliding_window is None


def test_rope_keys_present_are_read_as_written():
    c = drafter_config_from_dict(speculators_llama(), _target())
    assert c.rope == LLAMA31_ROPE
    c = drafter_config_from_dict(angelslim_qwen3_8b(), _target(
        vocab_size=151936, intermediate_size=12288, num_layers=36, rope=RopeConfig(theta=1e6)))
    assert c.rope == RopeConfig(theta=1000000.0)
    v5 = speculators_llama(layer_extra={"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    del v5["transformer_layer_config"]["rope_theta"], v5["transformer_layer_config"]["rope_scaling"]
    assert drafter_config_from_dict(v5).rope == RopeConfig(theta=500000.0)


# ----------------------------------------------------------------------------- 2. metadata

def test_metadata_keys_are_ignored_and_listed_in_one_place():
    target = _target(vocab_size=151936, intermediate_size=12288, num_layers=36, rope=RopeConfig(theta=1e6))
    c = drafter_config_from_dict(angelslim_qwen3_8b(), target)
    assert {"target_model_type", "torch_dtype", "transformers_version"} <= IGNORED_METADATA_KEYS
    assert c.aux_layer_ids == (2, 18, 33) and c.draft_vocab_size == 32000
    assert (c.head_dim, c.rms_norm_eps, c.sliding_window) == (128, 1e-06, None)
    # keys that would change the computation are still refused, naming the key
    with pytest.raises(ConfigError, match="unknown drafter key 'fc_bias'"):
        drafter_config_from_dict({**angelslim_qwen3_8b(), "fc_bias": True}, target)
    with pytest.raises(UnsupportedDrafterError, match="logit_scale=2.0"):
        drafter_config_from_dict({**angelslim_qwen3_8b(), "logit_scale": 2.0}, target)
    with pytest.raises(UnsupportedDrafterError, match="mlp_bias=True"):
        drafter_config_from_dict({**angelslim_qwen3_8b(), "mlp_bias": True}, target)
    with pytest.raises(UnsupportedDrafterError, match="hidden_act='gelu'"):
        drafter_config_from_dict({**angelslim_qwen3_8b(), "hidden_act": "gelu"}, target)


# ----------------------------------------------------------------------------- 3. qwen2 layer

def test_qwen2_layer_runs_as_the_llama_eagle3_layer():
    """vLLM runs a qwen2 layer config as its Llama EAGLE-3 layer; biases come from
    attention_bias only (a Qwen2 config has none, SpecForge's trainer uses none),
    so a QwQ drafter has no biases although its target has qkv biases."""
    target = TargetConfig(**QWEN_TARGET)
    c = drafter_config_from_dict(specforge_qwq(), target)
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (5120, 40, 8, 128)
    assert (c.qkv_bias, c.o_bias) == (False, False)
    assert c.rope == RopeConfig(theta=1000000.0)
    assert c.sliding_window is None  # use_sliding_window false
    assert c.aux_layer_ids == (2, 32, 61) and c.draft_vocab_size == 32000
    biased = drafter_config_from_dict(specforge_qwq(attention_bias=True), target)
    assert (biased.qkv_bias, biased.o_bias) == (True, True)


def test_other_layer_families_are_refused_by_name():
    with pytest.raises(UnsupportedDrafterError, match="qwen3 drafter layer .*q_norm/k_norm"):
        drafter_config_from_dict(speculators_llama(layer_extra={"model_type": "qwen3"}))
    with pytest.raises(UnsupportedDrafterError, match="model_type 'gemma3_text' is not supported"):
        drafter_config_from_dict(specforge_llama(model_type="gemma3_text"), _target())


# ----------------------------------------------------------------------------- 4. window

def test_sliding_window_layer_is_parsed_and_exported():
    sliding = {"layer_types": ["sliding_attention"], "sliding_window": 4096}
    c = drafter_config_from_dict(speculators_llama(layer_extra=sliding), _target())
    assert c.sliding_window == 4096
    for to_dict in (drafter_config_to_native, drafter_config_to_speculators):
        assert drafter_config_from_dict(to_dict(c), _target()) == c
    # qwen2 without layer_types: derived as HF does (sliding from layer max_window_layers on)
    qwen = TargetConfig(**QWEN_TARGET)
    on = specforge_qwq(use_sliding_window=True, max_window_layers=0)
    assert drafter_config_from_dict(on, qwen).sliding_window == 32768
    assert drafter_config_from_dict(specforge_qwq(use_sliding_window=True), qwen).sliding_window is None
    # a sliding_window value on a Llama layer without layer_types: every engine runs full attention
    assert drafter_config_from_dict(specforge_llama(sliding_window=512), _target()).sliding_window is None


def test_bad_window_configs_are_refused():
    with pytest.raises(ConfigError, match="sliding_attention layer but sliding_window is None"):
        drafter_config_from_dict(speculators_llama(layer_extra={"layer_types": ["sliding_attention"]}))
    with pytest.raises(UnsupportedDrafterError, match="only full_attention and sliding_attention"):
        drafter_config_from_dict(speculators_llama(layer_extra={"layer_types": ["chunked_attention"],
                                                                "sliding_window": 8}))
    with pytest.raises(ConfigError, match="must list the one drafter layer"):
        drafter_config_from_dict(speculators_llama(layer_extra={"layer_types": ["full_attention"] * 2}))


def _small_cfg(window):
    return DrafterConfig(hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
                         vocab_size=50, draft_vocab_size=50, target_hidden_size=32,
                         aux_layer_ids=(1, 2, 3), sliding_window=window)


def test_sliding_window_attention_matches_brute_force():
    """Prefill 6 positions, then 4 more against the cache (window 3): every position's
    logits equal a full-attention pass over only its window, at the same positions."""
    w, n, split = 3, 10, 6
    cfg = _small_cfg(w)
    params = drafter.init_params(cfg, jax.random.PRNGKey(0), scale=0.3)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
    tokens = jax.random.randint(k1, (1, n), 0, cfg.vocab_size)
    hidden = jax.random.normal(k2, (1, n, cfg.hidden_size))
    embed = jax.random.normal(k3, (cfg.vocab_size, cfg.hidden_size))
    pos = jnp.arange(n, dtype=jnp.int32)[None]

    cache = drafter.create_cache(cfg, 1, n + 2)
    model = drafter.Drafter(cfg, params)
    a, _, cache = model.step(tokens[:, :split], hidden[:, :split], pos[:, :split], cache, embed=embed, impl="xla")
    b, _, _ = model.step(tokens[:, split:], hidden[:, split:], pos[:, split:], cache.commit(jnp.array([split])),
                         embed=embed, impl="xla")
    windowed = np.concatenate([np.asarray(a[0]), np.asarray(b[0])])

    full = cfg.replace(sliding_window=None)
    unwindowed = drafter.Drafter(full, params)
    brute = []
    for p in range(n):
        lo = max(0, p - w + 1)
        lg, _, _ = unwindowed.step(tokens[:, lo:p + 1], hidden[:, lo:p + 1], pos[:, lo:p + 1],
                                   drafter.create_cache(full, 1, w + 1), embed=embed, impl="xla")
        brute.append(np.asarray(lg[0, -1]))
    np.testing.assert_allclose(windowed, np.stack(brute), rtol=1e-5, atol=1e-5)
    # and the window matters here: full attention differs once p >= w
    nowin, _, _ = unwindowed.step(tokens, hidden, pos, drafter.create_cache(full, 1, n + 1), embed=embed,
                                  impl="xla")
    assert np.allclose(np.asarray(nowin[0, :w]), windowed[:w], atol=1e-5)
    assert not np.allclose(np.asarray(nowin[0, w:]), windowed[w:], atol=1e-3)


# ----------------------------------------------------------------------------- 5. aux ids

def test_aux_id_readings_per_publisher(caplog):
    target = _target()
    with caplog.at_level(logging.INFO, logger="eagle_jax.convert"):
        sf = drafter_config_from_dict(specforge_llama(), target)
    assert sf.aux_layer_ids == (2, 16, 29)  # SGLang outputs of layers 1, 15, 28 -> +1
    assert "eagle_config aux ids [1, 15, 28] read as outputs of layers (SGLang), +1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eagle_jax.convert"):
        sp = drafter_config_from_dict(speculators_llama(), target)
    assert sp.aux_layer_ids == (2, 16, 29)  # vLLM reads speculators ids as stored
    assert "inputs of layers (vLLM), as stored" in caplog.text
    # a native config without ids: the default (2, N//2, N-3), which SGLang spells [1, 15, 28]
    assert drafter_config_from_dict(safeailab_llama31(), target).aux_layer_ids == (2, 16, 29)
    # the override (argument, or the CLI's --aux-layer-semantics through the context)
    assert drafter_config_from_dict(specforge_llama(), target,
                                    aux_layer_semantics="vllm").aux_layer_ids == (1, 15, 28)
    with aux_layer_semantics_override("sglang"):
        assert drafter_config_from_dict(speculators_llama(), target).aux_layer_ids == (3, 17, 30)
    with pytest.raises(ConfigError, match="must be one of"):
        with aux_layer_semantics_override("sideways"):
            pass


# ----------------------------------------------------------------------------- 6. MLA

def test_mla_drafters_parse_to_an_mla_layer():
    """Recognised by architecture or by kv_lora_rank alone (tests/convert/test_mla_drafter.py
    checks every field against vLLM's reading)."""
    no_arch = {k: v for k, v in torchspec_kimi_mla().items() if k != "architectures"}
    for d in (torchspec_kimi_mla(), no_arch):
        cfg = drafter_config_from_dict(d)
        assert cfg.mla is not None and cfg.mla.kv_lora_rank == 512 and cfg.head_dim == 64
        assert cfg.aux_layer_ids == (1, 30, 57)  # eagle_config ids of a non-*ForCausalLMEagle3 config: as stored
