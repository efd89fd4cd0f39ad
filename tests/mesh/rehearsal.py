"""The rehearsal at real shapes (issue 44 item 5), on 8 simulated CPU devices as a 2x4 mesh: a
target with Llama-3.2-1B's shapes (eagle_jax/configs/llama-3.2-1b-instruct.json, the values of
its published config.json; random bfloat16 weights) and an EAGLE 3.1 drafter for it (the one
`eagle-jax train` builds: the target's layer dims, a draft vocabulary of 8192) serve a few
requests through the Engine, then the drafter trains a few steps; the bytes one device holds,
measured (its shards of `jax.live_arrays()`, plus the compiled step's `memory_analysis()` temp
bytes), beside `eagle-jax plan` and `plan --train` of the same settings. Writes one JSON object.

    python tests/mesh/rehearsal.py OUT.json

The target's layers are one buffer each, as `Generator` lays them out on CPU: with stacked layers
XLA:CPU's programs copied the weights they scan over (a compiled step's temp bytes were 1.8x
the weights), which `plan` does not count. Memory: the target is 2.47 GB and
the data axis holds it twice; with the drafter's training state (bfloat16 params and moments,
split over the data axis) the process peaked at 15 GB of resident memory (11 minutes on 2 cores).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
import zlib
from functools import partial

out_path = sys.argv[1]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from eagle_jax.config import SpecConfig  # noqa: E402
from eagle_jax.convert.hf import target_config_from_hf  # noqa: E402
from eagle_jax.engine import Engine, Sampling  # noqa: E402
from eagle_jax.generate import Generator  # noqa: E402
from eagle_jax.models import drafter, target  # noqa: E402
from eagle_jax.plan import plan, resolve_config  # noqa: E402
from eagle_jax.sharding import fused_layout, logical_axes, make_mesh, parse_mesh, partition_spec  # noqa: E402
from eagle_jax.tokenizer import Tokenizer  # noqa: E402
from eagle_jax.train.config import TrainConfig  # noqa: E402
from eagle_jax.train.initialize import build_drafter_config  # noqa: E402
from eagle_jax.train.plan import ESTIMATES, plan_train  # noqa: E402
from eagle_jax.train.trainer import Trainer  # noqa: E402
from eagle_jax.train.step import iter_batches  # noqa: E402

MESH, TARGET = "2x4", "llama-3.2-1b-instruct"
ROWS, MAX_LEN, K, NEW_TOKENS = 4, 256, 3, 8  # serving: engine rows, cache slots a row, chain length
TRAIN = dict(variant="eagle3.1", draft_vocab_size=8192, batch_size=2, seq_len=128, ttt_length=3, steps=2,
             dtype="bfloat16", param_dtype="bfloat16", mesh=MESH, fsdp=True, impl="xla", target=TARGET,
             progress=False, eval_prompts=0, eval_at_start=False, export=False, save_every=1000, resume=False)
GIB = 1 << 30

t_start = time.perf_counter()
shape = parse_mesh(MESH)
mesh = make_mesh(shape)
tcfg = target_config_from_hf(resolve_config(TARGET), TARGET)
dcfg = build_drafter_config(tcfg, TrainConfig(**dict(TRAIN, output_dir="unused")))


def random_on_mesh(model_type, cfg, init, seed: int):
    """(cfg laid out for the mesh's model axis, random bfloat16 params in the layout of `init`),
    each shard drawn on the host by itself (normal(0, 0.02); norms 1 + normal(0, 0.1)), seeded by
    its leaf and offset so that copies of a shard agree: no device and no host holds a whole
    weight (jax.random under jit drew every whole array on every device)."""
    cfg = dataclasses.replace(cfg, fused_groups=fused_layout(cfg, shape.model)[0])
    abstract = jax.eval_shape(partial(init, cfg, dtype=jnp.bfloat16), jax.random.PRNGKey(0))
    if "layers" in abstract:  # a target: one buffer a layer, as `Generator` lays it out on CPU
        stacked = abstract["layers"]
        abstract = dict(abstract, layers={i: {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in stacked.items()}
                                          for i in range(cfg.num_layers)})

    def make(path, leaf, axes):
        name = jax.tree_util.keystr(path)

        def draw(index):
            dims = [range(*s.indices(n)) for s, n in zip(index, leaf.shape)]
            rng = np.random.default_rng([seed, zlib.crc32(name.encode()), *[d.start for d in dims]])
            x = 0.02 * rng.standard_normal([len(d) for d in dims], dtype=np.float32)
            return (1 + 5 * x if "norm" in name else x).astype(leaf.dtype)

        sharding = NamedSharding(mesh, partition_spec(axes, leaf.shape, shape))
        return jax.make_array_from_callback(leaf.shape, sharding, draw)

    return cfg, jax.tree_util.tree_map_with_path(make, abstract, logical_axes(model_type(cfg, abstract)))


def per_device(arrays) -> int:
    """The most bytes one device holds of `arrays`: their shards on it, each buffer once (an array
    given twice, or a shard `jax.live_arrays()` lists beside its array once it was looked at)."""
    buffers = {(s.device.id, s.data.unsafe_buffer_pointer()): s.data.nbytes
               for x in arrays for s in x.addressable_shards}
    held: dict = {}
    for (device, _), n in buffers.items():
        held[device] = held.get(device, 0) + n
    return max(held.values())


def largest_live(but, n: int = 6) -> list:
    """The n live arrays (not in `but`; a shard `jax.live_arrays()` lists beside its array left
    out) of which one device holds the most: [shape, dtype, bytes a device]."""
    seen = {s.data.unsafe_buffer_pointer() for x in but for s in x.addressable_shards}
    found = []
    for x in sorted(jax.live_arrays(), key=lambda x: -len(x.addressable_shards)):
        shards = {s.data.unsafe_buffer_pointer(): s.data.nbytes for s in x.addressable_shards}
        if not set(shards) <= seen:
            found.append([list(x.shape), str(x.dtype), max(shards.values())])
        seen |= set(shards)
    return sorted(found, key=lambda f: -f[2])[:n]


def compare(planned: int, measured: int) -> dict:
    return {"plan": planned, "measured": measured, "plan_over_measured": round(planned / measured - 1, 4)}


def tokenizer() -> Tokenizer:
    """A word-level tokenizer of the target's ids ("t0" ..): the engine streams text."""
    from tokenizers import Tokenizer as Tokens, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = Tokens(models.WordLevel({f"t{i}": i for i in range(tcfg.vocab_size)}, unk_token="t0"))
    tokens.pre_tokenizer, tokens.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=tokens))


tcfg_mesh, tparams = random_on_mesh(target.Target, tcfg, target.init_params, 0)
rng = np.random.default_rng(0)
vocab = drafter.DraftVocab.from_target_ids(np.sort(rng.choice(tcfg.vocab_size, dcfg.draft_vocab_size, replace=False)),
                                           tcfg.vocab_size)
result = {"command": f"python tests/mesh/rehearsal.py {out_path}", "mesh": MESH, "target": TARGET,
          "drafter": {"variant": TRAIN["variant"], "hidden_size": dcfg.hidden_size,
                      "intermediate_size": dcfg.intermediate_size, "draft_vocab_size": dcfg.draft_vocab_size,
                      "aux_layer_ids": list(dcfg.aux_layer_ids)},
          "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "jax": jax.__version__}}

# ---------------------------------------------------------------------------------- serving
t0 = time.perf_counter()
dcfg_mesh, dparams = random_on_mesh(drafter.Drafter, dcfg, drafter.init_params, 1)
g = Generator(tcfg_mesh, tparams, tokenizer(), drafter=(dcfg_mesh, dparams, vocab), impl="xla", mesh=shape,
              spec=SpecConfig("chain", num_speculative_tokens=K, disable_by_batch_size=None))
engine = Engine(g, max_rows=ROWS, max_len=MAX_LEN, adaptive=False, speculative=True)
compiles = []
listen = lambda event, _s, **_: compiles.append(event) if event.startswith("/jax/core/compile/") else None
jax.monitoring.register_event_duration_secs_listener(listen)
prompts = [rng.integers(0, tcfg.vocab_size, n).tolist() for n in (20, 33, 47, 12)]
try:
    requests = [engine.submit(p, Sampling(max_new_tokens=NEW_TOKENS)) for p in prompts]
    texts = ["".join(ev.text for ev in r if hasattr(ev, "text")) for r in requests]
finally:
    jax.monitoring.unregister_event_duration_listener(listen)
live = per_device(jax.live_arrays())
with g.mesh_scope():
    step = engine._programs.step_rows.lower(g.target_params, engine._dparams, engine._vocab, engine._state,
                                            lc=engine.lc, rows=engine.max_rows,
                                            depth=engine.depth).compile().memory_analysis()
served = plan(tcfg, dcfg, shape, batch=ROWS, context=MAX_LEN - (K + 1), verify_tokens=K + 1, dtype="bfloat16")
parts = served["bytes_per_device"]
held = sum(v for k, v in parts.items() if not k.endswith("activations"))
result["serve"] = {
    "requests": len(prompts), "new_tokens": [len(t.split()) for t in texts], "compiles_after_warmup": len(compiles),
    "engine": {"rows": ROWS, "max_len": MAX_LEN, "chain_k": K},
    "plan_command": f"eagle-jax plan --target {TARGET} --mesh {MESH} --batch {ROWS} --context {MAX_LEN - K - 1} "
                    f"--verify-tokens {K + 1} (drafter: the one above, not a shipped config)",
    "plan_bytes_per_device": parts,
    "weights": compare(parts["target weights"] + parts["drafter weights"],
                       per_device(jax.tree.leaves((g.target_params, g.drafter_params)))),
    "held": compare(held, live),
    "largest_other_live": largest_live(jax.tree.leaves((g.target_params, g.drafter_params))),
    "total": compare(served["total_per_device"], live + step.temp_size_in_bytes),
    "step_temp_bytes": step.temp_size_in_bytes, "wall_s": round(time.perf_counter() - t0, 1)}
engine.close()
del engine, g, dparams, requests
print(json.dumps(result["serve"]), file=sys.stderr)

# ---------------------------------------------------------------------------------- training
t0 = time.perf_counter()
examples = [{"id": f"r{i}", "input_ids": rng.integers(0, tcfg.vocab_size, TRAIN["seq_len"]).astype(np.int32),
             "loss_mask": (np.arange(TRAIN["seq_len"]) >= 16).astype(np.int32)} for i in range(8)]
with tempfile.TemporaryDirectory() as d:
    cfg = TrainConfig(**dict(TRAIN, output_dir=d))
    tr = Trainer(cfg, tcfg_mesh, tparams, examples, vocab)
    summary = tr.run()
    losses = [json.loads(line)["loss"] for line in open(tr.log_path) if '"train"' in line]
state = tr.state
with jax.set_mesh(tr.mesh):
    feats = tr.batch_features(next(iter_batches(examples, cfg.batch_size, cfg.seq_len, seed=1)))
    live = per_device(jax.live_arrays())
    features = tr.feature_fn.lower(tr.feature_params, feats["input_ids"], tr.draft_head, tr.t2d,
                                   tr.forward_params).compile().memory_analysis()
    step = tr.train_step.lower(state, tr.tparams["embed"], feats).compile().memory_analysis()
trained = plan_train(tcfg, cfg)
parts = trained["bytes_per_device"]
measured = {"target weights": per_device(jax.tree.leaves((tr.tparams, tr.feature_params))),
            "target head columns": per_device([tr.draft_head]),
            "drafter params": per_device(jax.tree.leaves(state["params"])),
            "optimizer state": per_device(jax.tree.leaves({k: v for k, v in state.items() if k != "params"})),
            "batch features": per_device(jax.tree.leaves(feats)),
            "feature pass activations": features.temp_size_in_bytes, "TTT activations": step.temp_size_in_bytes}
held = sum(v for k, v in parts.items() if k not in ESTIMATES)
result["train"] = {
    "steps": summary["step"], "loss": losses, "settings": {k: TRAIN[k] for k in TRAIN if k in (
        "variant", "draft_vocab_size", "batch_size", "seq_len", "ttt_length", "dtype", "param_dtype", "fsdp")},
    "plan_command": f"eagle-jax plan --train --target {TARGET} --mesh {MESH} --fsdp --variant eagle3.1 "
                    f"--draft-vocab-size 8192 --batch 2 --seq-len 128 --ttt-length 3 --dtype bfloat16 "
                    "--param-dtype bfloat16",
    "parts": {k: compare(parts[k], v) for k, v in measured.items()},
    "held": compare(held, live),
    "largest_other_live": largest_live(jax.tree.leaves((tr.tparams, tr.feature_params, tr.draft_head, state, feats))),
    "total": compare(trained["total_per_device"], live + max(features.temp_size_in_bytes, step.temp_size_in_bytes)),
    "wall_s": round(time.perf_counter() - t0, 1)}
result["wall_s"] = round(time.perf_counter() - t_start, 1)
with open(out_path, "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
print(json.dumps(result))
