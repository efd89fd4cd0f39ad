"""The collectives of compiled HLO text, for the mesh scripts (run_on_mesh.py, run_moe_on_mesh.py,
train_on_mesh.py)."""

from __future__ import annotations

import re

_COLLECTIVE = re.compile(r"= \(?((?:[a-z0-9]+\[[0-9,]*\][^ ]*,? ?)+)\)? (all-gather|all-reduce|reduce-scatter|"
                         r"collective-permute|all-to-all)(?:-start)?\(")


def compiled_collectives(text: str) -> dict:
    """{kind: [result shape, ...]} of each kind of collective in compiled HLO text."""
    out = {}
    for m in _COLLECTIVE.finditer(text):
        shapes = [[int(x) for x in dims.split(",") if x] for dims in re.findall(r"\[([0-9,]*)\]", m.group(1))]
        out.setdefault(m.group(2), []).extend(s for s in shapes if s not in out.get(m.group(2), []))
    return out


def step_collectives(g, prompts) -> dict:
    """Result shapes of each kind of collective in one compiled speculative step of Generator `g`
    (on its mesh) over `prompts`, the shape of its target cache's k and the PartitionSpec it has
    on the mesh, and how many shard_map and pallas_call equations the step's jaxpr has."""
    from eagle_jax.engine.batch import batch_inputs
    from eagle_jax.spec_decode import loop

    ids = g.encode_prompts(prompts, chat=False)
    lc, args, static = batch_inputs(g, ids, g.requests(len(ids), max_new_tokens=12))
    with g.mesh_scope():
        state = loop.prefill_jit(g.target_params, g.drafter_params, g.vocab, *args, **static)
        traced = loop.step_jit.trace(g.target_params, g.drafter_params, g.vocab, state, lc=lc)
        text = traced.lower().compile().as_text()
    jaxpr = str(traced.jaxpr)
    return {"collectives": compiled_collectives(text), "cache": list(state.tcache.k.shape),
            "cache_spec": str(state.tcache.k.sharding.spec),
            "kernels": {"shard_map": jaxpr.count("shard_map["), "pallas_call": jaxpr.count("pallas_call[")}}
