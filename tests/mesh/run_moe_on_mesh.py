"""Run on simulated CPU devices (a subprocess of tests/mesh/test_mesh.py: the device count must be set
before jax starts): greedy output of tiny MoE targets, plain and speculative with a random drafter,
unsharded and on each mesh given; the collectives of one sharded speculative step, and how the
experts, MLA heads and caches are laid out. Prints one JSON object.

    python tests/mesh/run_moe_on_mesh.py [--methods plain,chain,tree] qwen3_moe,deepseek 1x8 2x4

"qwen3_moe": GQA attention with q/k norms, softmax routing, layer 2 dense. "deepseek": MLA (its
compressed cache, YaRN), grouped sigmoid routing with the correction bias, a shared expert, layer 0
dense. Both: 8 heads, 8 experts (2 per token), every width a multiple of 8, so every model axis up
to 8 splits the heads, the experts (whole) and the dense and shared MLPs.
"""

from __future__ import annotations

import json
import os
import sys

args = sys.argv[1:]
methods = ("plain", "chain", "tree")
if args[:1] == ["--methods"]:  # the methods to run (comma-separated), unsharded and on each mesh
    methods, args = tuple(args[1].split(",")), args[2:]
kinds, meshes = args[0].split(","), args[1:]
devices = max((int(d) * int(m) for d, m in (x.split("x") for x in meshes)), default=1)
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"

import jax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spec_decode"))
import spec_helpers as H  # noqa: E402
from collectives import step_collectives  # noqa: E402

from eagle_jax.config import MLAConfig, MoEConfig, RopeConfig, SpecConfig, TargetConfig  # noqa: E402
from eagle_jax.generate import Generator  # noqa: E402
from eagle_jax.models import target  # noqa: E402
from eagle_jax.sharding import parse_mesh  # noqa: E402

COMMON = dict(vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=8, num_kv_heads=8,
              head_dim=8, max_position_embeddings=512)
CONFIGS = {
    "qwen3_moe": TargetConfig(**COMMON, qk_norm=True, architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe",
                              moe=MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=16,
                                            layers=(0, 1, 3), norm_topk_prob=True)),
    "deepseek": TargetConfig(**COMMON, architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3",
                             rope=RopeConfig(scaling_type="yarn", factor=4.0, original_max_position_embeddings=16),
                             moe=MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=16, layers=(1, 2, 3),
                                           scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                                           num_groups=4, topk_groups=2, num_shared_experts=1),
                             mla=MLAConfig(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                           v_head_dim=8, mscale_all_dim=1.0)),
}
SPECS = {"chain": SpecConfig(disable_by_batch_size=None),
         "tree": SpecConfig(method="tree", tree_top_k=2, tree_depth=3, tree_total_tokens=6, disable_by_batch_size=None)}
PROMPTS = H.random_prompts(8, [5, 9, 7, 12, 6, 10])  # 6 rows: [tokens, H] of a shard is no weight's shape
SHOWN = ("experts_gate_up", "experts_down", "router", "shared_gate_up", "shared_down", "wq_b", "wkv_b", "wo",
         "wqkv_a", "wqkv")  # the leaves of layer 1 (a MoE layer in both) whose layout is reported


def run(cfg, params, drafter, mesh, method):
    kw = {} if method == "plain" else {"drafter": drafter, "spec": SPECS[method]}
    g = Generator(cfg, params, impl="xla", mesh=parse_mesh(mesh) if mesh else None, **kw)
    out = g.generate(PROMPTS, max_new_tokens=12, chat=False)
    return g, {"tokens": out.token_ids, "accepted": out.stats.get("accepted_tokens", 0)}


result = {}
for kind in kinds:
    cfg = CONFIGS[kind]
    params = target.init_params(cfg, jax.random.PRNGKey(0), scale=0.3)
    drafter = H.smollm2_random_drafter(cfg, "eagle3.1", draft_vocab=8, scale=0.3)
    layer = params["layers"][1]
    got = result[kind] = {
        "reference": {m: run(cfg, params, drafter, None, m)[1] for m in methods},
        "weight_shapes": sorted({tuple(x.shape) for p in params["layers"].values() for x in p.values()}
                                | {tuple(params["embed"].shape), tuple(params["lm_head"].shape)}),
        "experts": [cfg.moe.num_experts, *layer["experts_gate_up"].shape[1:]], "meshes": {}}
    for mesh in meshes:
        out = got["meshes"][mesh] = {}
        for method in methods:
            g, out[method] = run(cfg, params, drafter, mesh, method)
            if method == "chain":
                out.update(step_collectives(g, PROMPTS))
                lay = g.target_params["layers"][1]
                out["specs"] = {name: str(lay[name].sharding.spec) for name in SHOWN if name in lay}
                out["shards"] = {name: list(lay[name].sharding.shard_shape(lay[name].shape))
                                 for name in SHOWN if name in lay}
print(json.dumps(result))
