"""MoE and MLA targets (Qwen3-MoE, DeepSeek-V3 / Kimi K2) loaded from HF directories
against transformers' `Qwen3MoeForCausalLM` and `DeepseekV3ForCausalLM` with the
same random weights (fp32, small sizes): the logits over prompts longer than YaRN's
original context, every expert chosen by some token of the batch (asserted on the
reference's own routing, which ours must equal), the compressed MLA cache holding
what transformers' cache holds, and decoding token by token from that cache equal to
the full forward.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.config import CheckpointError, ConfigError
from eagle_jax.convert import load_hf_directory, load_target, target_config_from_hf
from eagle_jax.convert.safetensors_io import SafetensorsFile, save_safetensors
from eagle_jax.models import moe, target

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT_LEN = 40  # past original_max_position_embeddings (16): YaRN's interpolated band is used
DECODE = 8  # tokens decoded one at a time after the prompt
MAX_LEN = PROMPT_LEN + DECODE
BATCH = 4

CASES = {
    # q_lora, interleaved rope, YaRN with mscale != mscale_all_dim (both the cos/sin factor and
    # the softmax scale move), grouped sigmoid choice, 2 shared experts, the MTP layer skipped.
    "deepseek_v3": dict(
        arch="deepseek", vocab_size=96, hidden_size=48, intermediate_size=72, moe_intermediate_size=24,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
        n_routed_experts=8, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
        qk_nope_head_dim=10, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=128, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 0.7}),
    # Kimi K2's shape of config: model_type kimi_k2, one group, no query low-rank projection
    # (DeepSeek-V2-Lite's), rotate-half rope, unnormalised top-k weights.
    "kimi_k2": dict(
        arch="deepseek", model_type="kimi_k2", vocab_size=96, hidden_size=48, intermediate_size=72,
        moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        v_head_dim=12, qk_nope_head_dim=10, n_group=1, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, norm_topk_prob=False, routed_scaling_factor=2.827, rope_interleave=False,
        max_position_embeddings=128, rms_norm_eps=1e-6, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                         "original_max_position_embeddings": 16, "beta_fast": 1.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0}),
    # Qwen3-MoE: a dense layer by mlp_only_layers and others by decoder_sparse_step.
    "qwen3_moe": dict(
        arch="qwen3_moe", vocab_size=96, hidden_size=48, intermediate_size=72, moe_intermediate_size=24,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=True,
        max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16}),
    "qwen3_moe_step2": dict(
        arch="qwen3_moe", vocab_size=96, hidden_size=48, intermediate_size=72, moe_intermediate_size=24,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=False, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


def build(name: str, out_dir: str, seed: int = 0):
    """A transformers model of CASES[name] with random weights, the routers' too (and the
    correction bias, a buffer), saved to `out_dir`; returns the float32 torch model."""
    spec = dict(CASES[name])
    arch = spec.pop("arch")
    model_type = spec.pop("model_type", None)
    config_cls, model_cls = {
        "deepseek": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**spec)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.15)
            else:
                p.normal_(0.0, 0.1)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(out_dir)
    if model_type is not None:  # as Kimi K2 ships it: its own model_type, the DeepSeek-V3 architecture
        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["model_type"] = model_type
        with open(path, "w") as f:
            json.dump(config, f)
    return model


@pytest.fixture(scope="module")
def case(request, tmp_path_factory):
    """(cfg, params, torch model, prompts [B, T], reference logits, reference routing) of a case."""
    name = request.param
    d = str(tmp_path_factory.mktemp(name))
    model = build(name, d)
    cfg, params = load_hf_directory(d)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (BATCH, MAX_LEN)).astype(np.int32)
    routing = {}  # layer -> (router input [N, H], chosen experts [N, k])

    def hook(layer):
        def capture(module, args, out):
            routing[layer] = (args[0].reshape(-1, args[0].shape[-1]).numpy(), out[2].numpy())
        return capture

    handles = [layer.mlp.gate.register_forward_hook(hook(i))
               for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        out = model(torch.as_tensor(ids, dtype=torch.long), use_cache=True)
    for h in handles:
        h.remove()
    return dict(name=name, dir=d, cfg=cfg, params=params, model=model, ids=ids, logits=out.logits.numpy(),
                routing=routing, hf_cache=out.cache)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def _forward(params, tokens, positions, cache, *, cfg):
    model = target.Target(cfg, params)
    hidden, cache, _ = model(tokens, positions, cache, impl="xla")
    return model.logits(hidden, impl="xla"), cache


forward = jax.jit(_forward, static_argnames=("cfg",))
ALL = pytest.mark.parametrize("case", list(CASES), indirect=True)


@ALL
def test_config_fields(case):
    cfg, spec = case["cfg"], CASES[case["name"]]
    m = cfg.moe
    assert (m.num_experts, m.experts_per_token, m.intermediate_size) == (
        spec.get("n_routed_experts", spec.get("num_experts")), spec["num_experts_per_tok"],
        spec["moe_intermediate_size"])
    moe_layers = [i for i, layer in enumerate(case["model"].model.layers) if hasattr(layer.mlp, "gate")]
    assert list(m.layers) == moe_layers and 0 < len(moe_layers) < cfg.num_layers
    if spec["arch"] == "deepseek":
        assert cfg.mla is not None and cfg.mla.q_lora_rank == spec["q_lora_rank"]
        assert cfg.mla.rope_interleave == spec.get("rope_interleave", True)
        assert (m.scoring, m.num_groups, m.topk_groups, m.num_shared_experts) == (
            "sigmoid", spec["n_group"], spec["topk_group"], spec["n_shared_experts"])
        assert cfg.head_dim == spec["qk_rope_head_dim"] and cfg.architecture == "DeepseekV3ForCausalLM"
    else:
        assert cfg.mla is None and cfg.qk_norm and m.scoring == "softmax"


@ALL
def test_routing_reaches_every_expert_and_equals_the_reference(case):
    """The reference's routing of the batch chooses each expert of every MoE layer (so the
    logits test below covers them all), and our router chooses the same experts from the
    same inputs."""
    cfg, params = case["cfg"], case["params"]
    assert sorted(case["routing"]) == list(cfg.moe.layers)
    for layer, (x, chosen) in case["routing"].items():
        assert set(chosen.reshape(-1).tolist()) == set(range(cfg.moe.num_experts)), layer
        p = params["layers"][layer]
        _, ours = moe.route(cfg.moe, jnp.asarray(x), p["router"], p.get("router_bias"))
        np.testing.assert_array_equal(np.sort(np.asarray(ours), -1), np.sort(chosen, -1))


def prompt_forward(case):
    """Our logits [B, PROMPT_LEN, V] and cache after the prompt (committed)."""
    cfg = case["cfg"]
    pos = jnp.broadcast_to(jnp.arange(PROMPT_LEN, dtype=jnp.int32), (BATCH, PROMPT_LEN))
    logits, cache = forward(case["params"], jnp.asarray(case["ids"][:, :PROMPT_LEN]), pos,
                            target.create_cache(cfg, BATCH, MAX_LEN), cfg=cfg)
    return np.asarray(logits), cache.commit(jnp.full((BATCH,), PROMPT_LEN))


@ALL
def test_logits_equal_transformers(case):
    logits, _ = prompt_forward(case)
    ref = case["logits"][:, :PROMPT_LEN]
    assert rel_err(logits, ref) < 1e-4
    np.testing.assert_array_equal(logits.argmax(-1), ref.argmax(-1))


@ALL
def test_decode_from_the_cache_equals_the_full_forward(case):
    """After the prompt, one token a step from the cache: each step's logits equal the
    reference's full forward at that position. For MLA the cache holds the normed latent
    and the rotated rope key per token, what transformers' cache holds."""
    cfg, params, ids, ref = case["cfg"], case["params"], case["ids"], case["logits"]
    logits, cache = prompt_forward(case)
    steps = [logits]
    for t in range(PROMPT_LEN, MAX_LEN):
        logits, cache = forward(params, jnp.asarray(ids[:, t:t + 1]), jnp.full((BATCH, 1), t, jnp.int32), cache,
                                cfg=cfg)
        cache = cache.commit(jnp.ones((BATCH,), jnp.int32))
        steps.append(np.asarray(logits))
    assert rel_err(np.concatenate(steps, axis=1), ref) < 1e-4
    if cfg.mla is not None:
        m = cfg.mla
        assert cache.k.shape == (cfg.num_layers, BATCH, 1, MAX_LEN, m.kv_lora_rank)
        assert cache.v.shape == (cfg.num_layers, BATCH, 1, MAX_LEN, m.qk_rope_head_dim)
        for i, layer in enumerate(case["hf_cache"].layers):
            np.testing.assert_allclose(np.asarray(cache.k[i]), layer.keys.numpy(), rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(np.asarray(cache.v[i]), layer.values.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["deepseek_v3"], indirect=True)
def test_converted_copy_loads_the_same(case, tmp_path):
    """Through `load_target`'s conversion cache and back: the same config (sub-configs
    included) and the same per-layer parameters."""
    first = load_target(case["dir"], cache_dir=str(tmp_path))
    again = load_target(case["dir"], cache_dir=str(tmp_path))
    assert again.cfg == first.cfg == case["cfg"]
    assert jax.tree.structure(again.params) == jax.tree.structure(case["params"])
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(case["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for loaded in (load_target(case["dir"], "bfloat16", cache_dir=str(tmp_path)),
                   load_target(case["dir"], "bfloat16", cache_dir=str(tmp_path))):  # converted, then cached
        layer = loaded.params["layers"][1]
        assert layer["router"].dtype == layer["router_bias"].dtype == jnp.float32
        assert layer["experts_gate_up"].dtype == layer["wqkv_a"].dtype == jnp.bfloat16


@pytest.mark.parametrize("case", ["deepseek_v3"], indirect=True)
def test_mtp_layers_are_skipped(case, tmp_path):
    """DeepSeek-V3 checkpoints carry `num_nextn_predict_layers` multi-token-prediction
    layers after the last one (model.layers.61 of V3): skipped as transformers and vLLM
    skip them, and unexpected where the config names none."""
    d = str(tmp_path / "mtp")
    shutil.copytree(case["dir"], d)
    path = os.path.join(d, "model.safetensors")
    tensors = {k: np.array(v) for k, v in SafetensorsFile(path).items()}
    layers = case["cfg"].num_layers
    tensors[f"model.layers.{layers}.eh_proj.weight"] = np.zeros((4, 4), np.float32)
    save_safetensors(path, tensors)
    cfg, params = load_hf_directory(d)  # the saved config says num_nextn_predict_layers: 1
    assert sorted(params["layers"]) == list(range(layers))
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**config, "num_nextn_predict_layers": 0}, f)
    with pytest.raises(CheckpointError, match=f"unexpected tensor.*model.layers.{layers}.eh_proj"):
        load_hf_directory(d)


DEEPSEEK_FIELDS = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=32, hidden_size=16,
    intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=8, q_lora_rank=None,
    qk_rope_head_dim=4, v_head_dim=4, qk_nope_head_dim=4, n_group=2, topk_group=1, num_experts_per_tok=2,
    first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0, max_position_embeddings=64)


@pytest.mark.parametrize("change, message", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"scoring_func": "softmax"}, "'scoring_func' = 'softmax'"),
    ({"topk_method": "greedy"}, "'topk_method' = 'greedy'"),
    ({"moe_layer_freq": 2}, "'moe_layer_freq' = 2"),
    ({"num_key_value_heads": 1}, "must equal num_attention_heads"),
    ({"attention_bias": True}, "'attention_bias' = True"),
    ({"q_lora_rank": "drop"}, "'q_lora_rank' is missing"),
    ({"n_group": 3}, "n_group (3) must divide the experts"),
    ({"num_experts_per_tok": 3}, "exceeds the experts of the 1 chosen group"),
    ({"model_type": "qwen3_moe"}, "contradicts architecture"),
])
def test_deepseek_config_errors(change, message):
    config = {**DEEPSEEK_FIELDS, **change}
    if change.get("q_lora_rank") == "drop":
        del config["q_lora_rank"]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        target_config_from_hf(config)


def test_kimi_k2_model_type_without_architectures():
    cfg = target_config_from_hf({**DEEPSEEK_FIELDS, "architectures": None, "model_type": "kimi_k2",
                                 "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1})
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.model_type == "deepseek_v3"
