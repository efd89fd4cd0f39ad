"""The rehearsal's feature pass (tests/mesh/rehearsal.py: Llama-3.2-1B's shapes in bfloat16 on a 2x4
mesh of simulated CPU devices, a batch of 2 x 128 tokens, the EAGLE 3.1 drafter's aux layers) compiled
from its arguments' shapes and shardings alone, nothing allocated (about 15 s): the temp bytes a device
needs (`memory_analysis()`, what the rehearsal measures of it) beside `plan --train`'s estimate, as one
JSON line. Compiled so at the committed run's commit (its `make_feature_fn` takes no vocab_shards),
the pass needed that run's measured 526015912 bytes exactly.

    python tests/mesh/rehearsal_feature_pass.py
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import partial

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from eagle_jax.convert.hf import target_config_from_hf  # noqa: E402
from eagle_jax.models import target  # noqa: E402
from eagle_jax.plan import resolve_config  # noqa: E402
from eagle_jax.sharding import fused_layout, logical_axes, make_mesh, parse_mesh, partition_spec  # noqa: E402
from eagle_jax.train import features  # noqa: E402
from eagle_jax.train.config import TrainConfig  # noqa: E402
from eagle_jax.train.initialize import build_drafter_config  # noqa: E402
from eagle_jax.train.plan import plan_train  # noqa: E402

MESH, TARGET = "2x4", "llama-3.2-1b-instruct"
TRAIN = dict(variant="eagle3.1", draft_vocab_size=8192, batch_size=2, seq_len=128, ttt_length=3, dtype="bfloat16",
             param_dtype="bfloat16", mesh=MESH, fsdp=True, impl="xla", target=TARGET, output_dir="unused")

shape = parse_mesh(MESH)
mesh = make_mesh(shape)
tcfg = target_config_from_hf(resolve_config(TARGET), TARGET)
cfg = TrainConfig(**TRAIN)
# the target as rehearsal.py lays it out: fused projections grouped per model shard, one buffer a layer
mesh_cfg = dataclasses.replace(tcfg, fused_groups=fused_layout(tcfg, shape.model)[0])
abstract = jax.eval_shape(partial(target.init_params, mesh_cfg, dtype=jnp.bfloat16), jax.random.PRNGKey(0))
abstract = dict(abstract, layers={i: {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in abstract["layers"].items()}
                                  for i in range(tcfg.num_layers)})
params = jax.tree.map(lambda x, axes: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
    mesh, partition_spec(axes, x.shape, shape))), abstract, logical_axes(target.Target(mesh_cfg, abstract)))


def placed(shape_, dtype, *spec):
    return jax.ShapeDtypeStruct(shape_, dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))


fn = features.make_feature_fn(mesh_cfg, build_drafter_config(tcfg, cfg).aux_layer_ids, impl="xla",
                              vocab_shards=features.vocab_shards(params))
with jax.set_mesh(mesh):
    compiled = fn.lower(params, placed((cfg.batch_size, cfg.seq_len), jnp.int32, "data"),
                        placed((tcfg.hidden_size, cfg.draft_vocab_size), jnp.bfloat16, None, "model"),
                        placed((tcfg.vocab_size,), jnp.bool_), None).compile()
print(json.dumps({"temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                  "plan": plan_train(tcfg, cfg)["bytes_per_device"]["feature pass activations"]}))
