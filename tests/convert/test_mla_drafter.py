"""The MLA drafter (vLLM's `Eagle3DeepseekV2ForCausalLM`, the Kimi K2.x EAGLE 3.1 drafters):
its config read as vLLM reads it, its checkpoint both ways, and its steps against an
independent PyTorch reference written from vLLM's computation (torch_mla_drafter_ref.py).

No stored copy of the published `lightseekorg/kimi-k2.6-eagle3.1-mla` config.json could
be found (docs/notes/mla-drafter.md). `kimi_k26_eagle31_mla` is therefore a fixture built
from the fields vLLM's deepseek_eagle3.py reads, in the layout of the config TorchSpec
ships for its Kimi K2.5 MLA drafter (configs/draft_models/kimi_k25_eagle3_mla.json), with
the EAGLE 3.1 flags (`fc_norm`, `norm_output`) the 3.1 drafter's serving docs name and
the aux ids as TorchSpec's export writes them for kimi_k2 (its [1, 29, 57] + 1).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.config import ConfigError, DrafterConfig, MLAConfig, RopeConfig
from eagle_jax.convert.drafter_config import (
    UnsupportedDrafterError,
    drafter_config_from_dict,
    drafter_config_to_native,
    drafter_config_to_speculators,
)
from eagle_jax.models import drafter

KIMI_YARN = {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
             "original_max_position_embeddings": 4096, "type": "yarn"}


def kimi_k26_eagle31_mla() -> dict:
    """The Kimi K2.6 EAGLE 3.1 MLA drafter's config (a fixture: see the module docstring)."""
    return {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2",
            "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 1,
            "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "hidden_act": "silu",
            "rms_norm_eps": 1e-05, "vocab_size": 163840, "draft_vocab_size": 163840, "torch_dtype": "bfloat16",
            "rope_theta": 50000.0, "rope_scaling": dict(KIMI_YARN), "max_position_embeddings": 262144,
            "fc_norm": True, "norm_output": True,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True,
                             "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                             "use_mtp_layernorm": False},
            "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 0}


KIMI_DRAFTER = DrafterConfig(
    hidden_size=7168, intermediate_size=18432, num_heads=64, num_kv_heads=64, head_dim=64, vocab_size=163840,
    draft_vocab_size=163840, target_hidden_size=7168, aux_layer_ids=(2, 30, 58), rms_norm_eps=1e-5,
    # mscale == mscale_all_dim: cos/sin unscaled (vLLM's deepseek_yarn), not YaRN's 0.1 ln(64) + 1
    rope=RopeConfig(theta=50000.0, scaling_type="yarn", factor=64.0, original_max_position_embeddings=4096,
                    beta_fast=1.0, beta_slow=1.0, attention_factor=1.0),
    max_position_embeddings=262144, fc_norm=True, norm_output=True,
    mla=MLAConfig(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  mscale_all_dim=1.0, norm_eps=1e-5))


# ----------------------------------------------------------------------------- config


def test_kimi_config_reads_every_field_as_vllm_does():
    assert drafter_config_from_dict(kimi_k26_eagle31_mla()) == KIMI_DRAFTER
    # transformers 5 spells the rope `rope_parameters` (rope_theta inside)
    d = kimi_k26_eagle31_mla()
    d["rope_parameters"] = {**d.pop("rope_scaling"), "rope_theta": d.pop("rope_theta") * 2}
    d["rope_theta"] = 1.0  # the one inside rope_parameters wins, as in transformers 5
    assert drafter_config_from_dict(d).rope.theta == 100000.0
    # unequal mscales scale cos/sin by mscale(f, mscale) / mscale(f, mscale_all_dim)
    d = kimi_k26_eagle31_mla()
    d["rope_scaling"]["mscale_all_dim"] = 0.5
    cfg = drafter_config_from_dict(d)
    assert cfg.mla.mscale_all_dim == 0.5
    assert cfg.rope.attention_factor == pytest.approx((0.1 * np.log(64) + 1) / (0.05 * np.log(64) + 1))
    # no rope_scaling: plain RoPE at rope_theta; q_lora_rank null: queries straight from the 2H input
    d = kimi_k26_eagle31_mla()
    d.update(rope_scaling=None, q_lora_rank=None)
    cfg = drafter_config_from_dict(d)
    assert cfg.rope == RopeConfig(theta=50000.0) and cfg.mla.q_lora_rank is None and cfg.mla.mscale_all_dim == 0


@pytest.mark.parametrize("key", ["kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                 "v_head_dim", "rms_norm_eps", "rope_theta"])
def test_a_field_the_layer_uses_is_never_defaulted(key):
    d = kimi_k26_eagle31_mla()
    del d[key]
    with pytest.raises(ConfigError, match=f"lacks \\['{key}'\\]"):
        drafter_config_from_dict(d)


@pytest.mark.parametrize("key", ["factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                                 "mscale_all_dim"])
def test_a_yarn_field_is_never_defaulted(key):
    d = kimi_k26_eagle31_mla()
    del d["rope_scaling"][key]
    with pytest.raises(ConfigError, match=f"YaRN rope_scaling .* lacks \\['{key}'\\]"):
        drafter_config_from_dict(d)


@pytest.mark.parametrize("change,match", [
    ({"rope_interleave": False}, "rope_interleave=False"),
    ({"index_topk": 2048}, "index_topk"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["sliding_attention"], "sliding_window": 512}, "full_attention"),
    ({"rope_scaling": {**KIMI_YARN, "type": "linear"}}, "rope type 'linear'"),
    ({"rope_scaling": {**KIMI_YARN, "attn_factor": 2.0}}, "attn_factor"),
    ({"rope_scaling": {**KIMI_YARN, "attention_factor": 1.2}}, "attention_factor"),
    ({"rope_scaling": {**KIMI_YARN, "apply_yarn_scaling": False}}, "apply_yarn_scaling"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_mtp_layernorm": True}},
     "use_mtp_layernorm"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_keys_that_change_the_computation_are_refused(change, match):
    d = kimi_k26_eagle31_mla()
    d.update(change)
    with pytest.raises(ConfigError, match=match):
        drafter_config_from_dict(d)


def test_config_round_trips_through_the_native_format():
    native = drafter_config_to_native(KIMI_DRAFTER)
    assert native["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert native["rope_scaling"]["mscale"] == native["rope_scaling"]["mscale_all_dim"] == 1.0
    assert drafter_config_from_dict(json.loads(json.dumps(native))) == KIMI_DRAFTER
    for cfg in (KIMI_DRAFTER.replace(rope=RopeConfig(theta=10000.0)),
                KIMI_DRAFTER.replace(mla=dataclasses.replace(KIMI_DRAFTER.mla, q_lora_rank=None))):
        back = drafter_config_from_dict(drafter_config_to_native(cfg))
        assert back.rope == cfg.rope and back.mla.q_lora_rank == cfg.mla.q_lora_rank
    with pytest.raises(ConfigError, match="speculators has no MLA drafter format"):
        drafter_config_to_speculators(KIMI_DRAFTER)
    speculators = {"speculators_model_type": "eagle3", "transformer_layer_config": kimi_k26_eagle31_mla()}
    with pytest.raises(UnsupportedDrafterError, match="speculators config describes a Llama-style layer"):
        drafter_config_from_dict(speculators)


# ----------------------------------------------------------------------------- against the reference

@pytest.fixture(scope="module")
def ref_mod():
    pytest.importorskip("torch")
    pytest.importorskip("safetensors.torch")
    name = "torch_mla_drafter_ref"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


T = 7
# A tiny Kimi drafter (its YaRN, but a factor and original length small enough that short
# prompts reach the interpolated frequencies; unequal mscales), and the plainest variant.
VARIANTS = {
    "kimi": dict(rope_scaling={**KIMI_YARN, "factor": 8.0, "original_max_position_embeddings": 4,
                               "mscale": 0.8, "mscale_all_dim": 0.5}),
    "no_q_lora_no_scaling": dict(q_lora_rank=None, rope_scaling=None, fc_norm=False, norm_output=False,
                                 norm_before_residual=True, rope_theta=10000.0),
}


def _build(ref_mod, name, seed=0):
    import torch

    spec = ref_mod.MLASpec(**VARIANTS[name])
    ref = ref_mod.TorchMLADrafter(spec).randomize(seed)
    g = torch.Generator().manual_seed(seed + 100)
    aux = 2.0 * torch.randn(T, len(spec.aux_ids) * spec.target_hidden, generator=g)
    tokens = torch.randint(0, spec.vocab, (T,), generator=g)
    embed = torch.randn(spec.vocab, spec.hidden, generator=g)
    return ref, aux, tokens, embed


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.partial(jax.jit, static_argnums=1)
def step(params, cfg, tokens, hidden, positions, cache, embed):
    """`Drafter.step` on XLA, jitted (eagerly, each op would compile on its own)."""
    return drafter.Drafter(cfg, params).step(tokens, hidden, positions, cache, embed=embed, impl="xla")


def jax_chain(cfg, params, aux, tokens, embed, next_tokens):
    """torch_mla_drafter_ref.run_chain through `Drafter.step` with the cache (committing each
    step's tokens), fed the reference's tokens."""
    cache = drafter.create_cache(cfg, 1, T + len(next_tokens) + 1)
    hidden = drafter.Drafter(cfg, params).project_features(jnp.asarray(aux.numpy())[None], impl="xla")
    toks, pos = jnp.asarray(tokens.numpy(), jnp.int32)[None], jnp.arange(T, dtype=jnp.int32)[None]
    e = jnp.asarray(embed.numpy())
    outs = []
    for i, nxt in enumerate(next_tokens):
        logits, fb, cache = step(params, cfg, toks, hidden, pos, cache, e)
        cache = cache.commit(jnp.array([toks.shape[1]], jnp.int32))
        outs.append((logits[0], fb[0]))
        toks, hidden, pos = jnp.array([[nxt]], jnp.int32), fb[:, -1:], jnp.array([[T + i]], jnp.int32)
    return outs


@pytest.mark.parametrize("name", list(VARIANTS))
def test_steps_equal_the_reference_and_the_checkpoint_round_trips(ref_mod, name, tmp_path):
    """The reference's checkpoint (vLLM's keys, its config) loads; a 3-step chain with the
    cache gives the reference's logits and fed-back hidden states (fp32, 1e-5 relative); the
    native save reloads bit-exactly."""
    from eagle_jax.convert.drafter_formats import load_drafter, load_drafter_tensors, save_drafter

    ref, aux, tokens, embed = _build(ref_mod, name)
    cfg, params, vocab = load_drafter(ref.save(tmp_path / "ref"))
    assert cfg.mla is not None and cfg.mla.norm_eps == ref.s.eps
    torch_steps = ref_mod.run_chain(ref, aux, tokens, embed, steps=3)
    jax_steps = jax_chain(cfg, params, aux, tokens, embed, [s[2] for s in torch_steps])
    for i, ((t_logits, t_fb, t_next), (j_logits, j_fb)) in enumerate(zip(torch_steps, jax_steps)):
        assert rel(j_logits, t_logits.numpy()) < 1e-5, f"step {i}: logits"
        assert rel(j_fb, t_fb.numpy()) < 1e-5, f"step {i}: fed-back hidden state"
        assert int(np.argmax(np.asarray(j_logits)[-1])) == t_next, f"step {i}: next token"

    out = save_drafter(tmp_path / "native", cfg, params, vocab, format="native")
    cfg2, params2, _ = load_drafter(out)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    written, original = load_drafter_tensors(out), load_drafter_tensors(tmp_path / "ref")
    assert {k.replace("midlayer.", "layers.0.") for k in written} - {"d2t", "t2d"} == set(original)
    with pytest.raises(ConfigError, match="speculators has no MLA drafter format"):
        save_drafter(tmp_path / "spec", cfg, params, vocab, format="speculators")


def test_a_checkpoint_inconsistent_with_its_config_is_refused(ref_mod, tmp_path):
    from eagle_jax.convert.drafter_formats import CheckpointError, load_drafter

    ref, *_ = _build(ref_mod, "kimi")
    path = ref.save(tmp_path / "ref")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "q_lora_rank": None}))
    with pytest.raises(CheckpointError, match="q_proj.weight"):
        load_drafter(path)
    (path / "config.json").write_text(json.dumps({**config, "kv_lora_rank": 8}))
    with pytest.raises(CheckpointError, match=r"kv_a_\w+\.weight has shape .*kv_lora_rank"):
        load_drafter(path)


# ----------------------------------------------------------------------------- the cache


def test_decoding_from_the_cache_equals_the_full_forward():
    """One call over 9 positions equals the same positions fed in chunks (4, 1, 4) with
    each chunk committed: the compressed cache holds what the full forward attends to."""
    spec = VARIANTS["kimi"]
    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=4, head_dim=8, vocab_size=40,
                        draft_vocab_size=40, target_hidden_size=24, aux_layer_ids=(2, 4, 5), fc_norm=True,
                        norm_output=True,
                        rope=RopeConfig(theta=50000.0, scaling_type="yarn", factor=8.0, original_max_position_embeddings=4,
                                        beta_fast=1.0, beta_slow=1.0, attention_factor=1.3),
                        mla=MLAConfig(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                      v_head_dim=12, mscale_all_dim=spec["rope_scaling"]["mscale_all_dim"]))
    params = drafter.init_params(cfg, jax.random.PRNGKey(0), scale=0.3)
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    n = 9
    embed = jax.random.normal(keys[0], (40, 32))
    hidden = drafter.Drafter(cfg, params).project_features(jax.random.normal(keys[1], (2, n, 72)), impl="xla")
    tokens = jax.random.randint(keys[2], (2, n), 0, 40)
    pos = jnp.broadcast_to(jnp.arange(n), (2, n))
    full, fb_full, _ = step(params, cfg, tokens, hidden, pos, drafter.create_cache(cfg, 2, 16), embed)
    cache, parts = drafter.create_cache(cfg, 2, 16), []
    for a, b in ((0, 4), (4, 5), (5, 9)):
        logits, fb, cache = step(params, cfg, tokens[:, a:b], hidden[:, a:b], pos[:, a:b], cache, embed)
        cache = cache.commit(jnp.full((2,), b - a, jnp.int32))
        parts.append((logits, fb))
    np.testing.assert_allclose(np.concatenate([p[0] for p in parts], 1), full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts], 1), fb_full, rtol=1e-5, atol=1e-5)
    assert cache.k.shape == (1, 2, 1, 16, 16) and cache.v.shape == (1, 2, 1, 16, 8)  # latents, rope keys
