"""Run on simulated CPU devices (a subprocess of tests/mesh/test_mesh.py: the device count must be set
before jax starts): greedy output of a tiny target, plain and speculative, unsharded and on each mesh
given, and the collectives of one sharded speculative step. Prints one JSON object.

    python tests/mesh/run_on_mesh.py [--engine plain,chain,tree] 1x8 2x4

With `--join HOST:PORT N I` it is process I of N (tests/mesh/test_mesh.py): the devices
are split evenly between the processes, joined by `eagle_jax.runtime.initialize_distributed`,
and it decodes on the meshes only (the reference comes from a single process); the engine's
scheduler runs in process 0 and the others follow its calls (`Engine.follow`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

args = sys.argv[1:]
join = None
engine_methods = ("plain", "chain", "tree")
if args[:1] == ["--engine"]:  # the methods the engine runs (comma-separated; "" none)
    engine_methods, args = tuple(m for m in args[1].split(",") if m), args[2:]
if args[:1] == ["--join"]:  # process 0 runs the engine's scheduler, the others follow it (engine/lockstep.py)
    join, args = (args[1], int(args[2]), int(args[3])), args[4:]
meshes = args
devices = max((int(d) * int(m) for d, m in (x.split("x") for x in meshes)), default=1)
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices // (join[1] if join else 1)}"

import jax  # noqa: E402

if join:
    from eagle_jax.runtime import initialize_distributed  # noqa: E402

    initialize_distributed(*join)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spec_decode"))
import spec_helpers as H  # noqa: E402
from collectives import compiled_collectives, step_collectives  # noqa: E402

from eagle_jax.config import SpecConfig, TargetConfig  # noqa: E402
from eagle_jax.convert.drafter_formats import params_from_tensors, tensors_from_params  # noqa: E402
from eagle_jax.convert.registry import LoadedTarget, load_converted, save_converted  # noqa: E402
from eagle_jax.generate import Generator  # noqa: E402
from eagle_jax.engine import Engine, Sampling  # noqa: E402
from eagle_jax.models import target  # noqa: E402
from eagle_jax.models.drafter import Drafter  # noqa: E402
from eagle_jax.sharding import make_mesh, parse_mesh, shard_model, to_host  # noqa: E402

# 8 query and 8 KV heads of 8, MLP 128, vocabulary 8 (random drafts hit often): every mesh axis up to 8
# divides them.
cfg = TargetConfig(vocab_size=8, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8, num_kv_heads=8,
                   head_dim=8, max_position_embeddings=512)
params = target.init_params(cfg, jax.random.PRNGKey(0), scale=0.3)
drafter = H.smollm2_random_drafter(cfg, "eagle3.1", draft_vocab=8, scale=0.3)
prompts = H.random_prompts(8, [5, 9, 7, 12])
specs = {"chain": SpecConfig(disable_by_batch_size=None),
         "tree": SpecConfig(method="tree", tree_top_k=2, tree_depth=3, tree_total_tokens=6, disable_by_batch_size=None)}


def run(mesh, method, impl="xla"):
    kw = {} if method == "plain" else {"drafter": drafter, "spec": specs[method]}
    g = Generator(cfg, params, impl=impl, mesh=parse_mesh(mesh) if mesh else None, **kw)
    out = g.generate(prompts, max_new_tokens=12, chat=False)
    return g, {"tokens": out.token_ids, "accepted": out.stats.get("accepted_tokens", 0)}


def engine(mesh, method) -> dict:
    """The engine on the mesh, two rows a data shard: the prompts submitted at once (on one
    data shard more than its rows: they queue; on several, a row bucket of one row a shard),
    their greedy text; compiles after the warm-up (none); the collectives of its compiled
    step over every row and over its smallest row bucket; a stream."""
    kw = {} if method == "plain" else {"drafter": drafter, "spec": specs[method]}
    g = Generator(cfg, params, H.word_tokenizer(cfg.vocab_size), impl="xla", mesh=parse_mesh(mesh) if mesh else None, **kw)
    data = g.mesh.shape["data"] if g.mesh is not None else 1
    e = Engine(g, max_rows=2 * data, max_len=64, adaptive=False, speculative=method != "plain")
    if not e.leads:  # a process other than 0: it makes process 0's engine calls until it closes
        e.follow()
        return {"followed": e.closed}
    compiles = []
    listen = lambda event, _s, **_: compiles.append(event) if event.startswith("/jax/core/compile/") else None
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        reqs = [e.submit(p, Sampling(max_new_tokens=12)) for p in prompts]
        texts = ["".join(ev.text for ev in r if hasattr(ev, "text")) for r in reqs]
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    out = {"texts": texts, "compiles": len(compiles), "buckets": e.row_buckets}
    if jax.process_count() == 1:  # `Generator.stream` makes a one-row engine: one process only
        out["stream"] = "".join(g.stream(prompts[0], max_new_tokens=12, chat=False))
    if g.mesh is not None:
        with g.mesh_scope():
            for rows in sorted({e.row_buckets[0], e.max_rows}):
                text = e._programs.step_rows.lower(g.target_params, e._dparams, e._vocab, e._state, lc=e.lc,
                                                   rows=rows, depth=e.depth).compile().as_text()
                out[f"collectives_{rows}"] = compiled_collectives(text)
        out["cache"] = list(e._state.tcache.k.shape)
    e.close()
    return out


def loaded(mesh) -> dict:
    """The target written to a converted directory and read back, and the drafter's checkpoint
    tensors loaded (`load_drafter`'s last step: a config file would refuse the aux ids this
    4-layer target repeats), each straight onto the mesh (`load_converted(..., mesh=)`,
    `params_from_tensors(..., mesh=)`): their shardings and values against `shard_model` of the
    arrays in memory, and the greedy chain tokens they decode."""
    mesh_ = make_mesh(parse_mesh(mesh))
    dcfg, dparams, vocab = drafter
    with tempfile.TemporaryDirectory() as d:
        path = save_converted(LoadedTarget(cfg, params, None, "tiny"), os.path.join(d, "tiny"))
        got = load_converted(path, mesh=mesh_)
    got_drafter = params_from_tensors(dcfg, tensors_from_params(dcfg, dparams, vocab, "speculators"), mesh=mesh_)
    pairs = [(got.cfg, got.params, shard_model(target.Target, cfg, params, mesh_)),
             (got_drafter[0], got_drafter[1], shard_model(Drafter, dcfg, dparams, mesh_))]
    same_sharding = [jax.tree.map(lambda a, b: a.sharding == b.sharding, p, want) for _, p, (_, want) in pairs]
    same_value = [jax.tree.map(lambda a, b: bool((a == b).all()), to_host(p), to_host(want))
                  for _, p, (_, want) in pairs]
    g = Generator(got.cfg, got.params, impl="xla", mesh=parse_mesh(mesh), drafter=got_drafter, spec=specs["chain"])
    return {"same_shardings": all(jax.tree.leaves(same_sharding)),
            "same_values": all(jax.tree.leaves(same_value)),
            "fused_groups": [[c.fused_groups, want_cfg.fused_groups] for c, _, (want_cfg, _) in pairs],
            "sharded_leaves": [sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(p))
                               for _, p, _ in pairs],
            "tokens": g.generate(prompts, max_new_tokens=12, chat=False).token_ids}


result = {"reference": {}, "meshes": {}}
for method in ("plain", "chain", "tree") if not join else ():
    result["reference"][method] = run(None, method)[1]
    if method in engine_methods:
        result["reference"][method]["engine"] = engine(None, method)
        result["reference"][method]["engine"]["want"] = [H.word_tokenizer(cfg.vocab_size).decode(t, skip_special_tokens=True)
                                                         for t in result["reference"][method]["tokens"]]
for mesh in meshes:
    result["meshes"][mesh] = {}
    for method in ("plain", "chain", "tree"):
        g, out = run(mesh, method)
        result["meshes"][mesh][method] = dict(out, **({"engine": engine(mesh, method)} if method in engine_methods
                                                      else {}))
        if method == "chain":
            result["meshes"][mesh].update(step_collectives(g, prompts))
    # The Pallas kernels (interpreted on CPU) on each device's block, under shard_map.
    g, out = run(mesh, "chain", impl="interpret")
    result["meshes"][mesh]["pallas"] = {**out, **step_collectives(g, prompts)}
    result["meshes"][mesh]["loaded"] = loaded(mesh)
result["process"] = jax.process_index()
result["weight_shapes"] = sorted({tuple(x.shape[1:]) for x in params["layers"].values()}
                                | {tuple(params["embed"].shape), tuple(params["lm_head"].shape)})
print(json.dumps(result))
