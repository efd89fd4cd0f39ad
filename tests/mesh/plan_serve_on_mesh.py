"""`eagle-jax plan` (serving) against the real arrays of MLA + MoE targets on simulated CPU devices
(a subprocess of tests/test_plan.py: the device count is set before jax starts). For each case
(a target, a mesh, a batch) the target's parameters are put on the mesh as `Generator(mesh=...)`
puts a checkpoint's (`sharding.shard_model`), its cache as the engine places it (`shard_cache`, and
`row_shardings` for the engine's state), and a lazy drafter's feature buffers (`loop.create_feats`)
by `row_shardings`; prints one JSON object: per case, the most bytes any device holds of each
beside `plan`'s figure.

    python tests/mesh/plan_serve_on_mesh.py
"""

from __future__ import annotations

import json
import os
from functools import partial

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from eagle_jax.config import DrafterConfig, MLAConfig, MoEConfig, SpecConfig, TargetConfig  # noqa: E402
from eagle_jax.models import target  # noqa: E402
from eagle_jax.plan import plan  # noqa: E402
from eagle_jax.sharding import make_mesh, parse_mesh, row_shardings, shard_cache, shard_model  # noqa: E402
from eagle_jax.spec_decode import loop  # noqa: E402

# "even": 8 heads, 8 experts, every width a multiple of 8: a model axis up to 8 splits the MLA
# heads (q_b, kv_b, o), the experts (whole), the dense and the shared MLP and the vocabulary.
# "odd": 6 heads, 6 experts, odd widths and vocabulary: a model axis of 4 splits none of them.
# Both: the first layer dense, grouped sigmoid routing with a shared expert (DeepSeek-V3's).
CONFIGS = {
    "even": TargetConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=8, num_kv_heads=8,
        head_dim=8, max_position_embeddings=512,
        mla=MLAConfig(kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        moe=MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=32, layers=(1, 2), scoring="sigmoid",
                      norm_topk_prob=True, num_groups=2, topk_groups=1, num_shared_experts=1)),
    "odd": TargetConfig(
        vocab_size=250, hidden_size=48, intermediate_size=19, num_layers=3, num_heads=6, num_kv_heads=6,
        head_dim=8, max_position_embeddings=512,
        mla=MLAConfig(kv_lora_rank=20, q_lora_rank=None, qk_nope_head_dim=3, qk_rope_head_dim=8, v_head_dim=5),
        moe=MoEConfig(num_experts=6, experts_per_token=2, intermediate_size=9, layers=(1, 2), scoring="sigmoid",
                      norm_topk_prob=True, num_groups=3, topk_groups=2, num_shared_experts=1)),
}
# (config, mesh, batch): rows split over data, or (batch 3 on 2 data shards) whole
CASES = [("even", "1x1", 2), ("even", "1x8", 2), ("even", "2x4", 4), ("even", "4x2", 4), ("even", "2x4", 3),
         ("odd", "1x4", 2), ("odd", "2x4", 2)]
CONTEXT, VERIFY = 40, 8


def per_device(tree) -> int:
    """The most bytes any one device holds of the arrays of `tree`."""
    held: dict = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            held[s.device] = held.get(s.device, 0) + s.data.nbytes
    return max(held.values())


# host zeros of the parameters' shapes and dtypes: placed slice by slice, as a checkpoint is
# (`shard_params`); their values do not change their bytes, and random ones take a compile
params_of = {name: jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                                jax.eval_shape(partial(target.init_params, cfg, dtype=jnp.bfloat16), jax.random.key(0)))
             for name, cfg in CONFIGS.items()}
result = {}
for name, mesh_text, batch in CASES:
    cfg = CONFIGS[name]
    shape = parse_mesh(mesh_text)
    mesh = make_mesh(shape)
    dcfg = DrafterConfig(hidden_size=cfg.hidden_size, intermediate_size=32, num_heads=2, num_kv_heads=2, head_dim=8,
                         vocab_size=cfg.vocab_size, draft_vocab_size=64, target_hidden_size=cfg.hidden_size,
                         aux_layer_ids=(0, 1, 2))
    slots = CONTEXT + VERIFY
    planned = plan(cfg, dcfg, shape, batch=batch, context=CONTEXT, verify_tokens=VERIFY)["bytes_per_device"]
    _, sharded = shard_model(target.Target, cfg, params_of[name], mesh)
    cache = target.create_cache(cfg, batch, slots, jnp.bfloat16)
    placed = shard_cache(cache, mesh)
    lc = loop.LoopConfig(target=cfg, drafter=dcfg, spec=SpecConfig(), eos_ids=(), context_limit=slots,
                         catch_up_width=4)
    feats = loop.create_feats(lc, batch, slots)
    in_state = jax.device_put((cache, feats), row_shardings((cache, feats), mesh))
    result[f"{name}@{mesh_text}:{batch}"] = {
        "plan": {k: planned[k] for k in ("target weights", "target KV cache", "drafter features")},
        "measured": {"target weights": per_device(sharded),
                     "target KV cache": per_device((placed.k, placed.v)),
                     "target KV cache (engine state)": per_device((in_state[0].k, in_state[0].v)),
                     "drafter features": per_device(in_state[1])},
    }
print(json.dumps(result))
