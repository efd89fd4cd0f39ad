"""Opcode histograms of the compiled decoding programs, to show that a refactor compiles the same
programs (prefill and the run loop; plain, chain and tree; greedy and sampled with top-k / top-p):

    PYTHONPATH=/tmp/before python scripts/hlo_ops.py > before.json   # a worktree of the parent
    python scripts/hlo_ops.py > after.json
"""
import collections, json, re
import jax
from eagle_jax.config import SpecConfig
from eagle_jax.generate import Generator
from eagle_jax.engine.batch import batch_inputs
from eagle_jax.spec_decode import loop
out = {}
for name, spec in {"plain": None, "chain": SpecConfig("chain", num_speculative_tokens=3, disable_by_batch_size=None),
                   "tree": SpecConfig("tree", disable_by_batch_size=None)}.items():
    gen = Generator.load(draft=None) if spec is None else Generator.load(spec=spec)
    ids = gen.encode_prompts(["Write a haiku about JAX.", "hi"])
    for temp in (0.0, 0.7):
        lc, args, static = batch_inputs(gen, ids, gen.requests(len(ids), max_new_tokens=32, temperature=temp, top_k=20, top_p=0.9))
        d, v = gen.drafter_for(lc)
        pre = loop.prefill_jit.lower(gen.target_params, d, v, *args, **static).compile().as_text()
        state = jax.eval_shape(lambda *a: loop.prefill(gen.target_params, d, v, *a, **static), *args)
        run = loop.run_jit.lower(gen.target_params, d, v, state, lc=lc).compile().as_text()
        hist = lambda t: dict(sorted(collections.Counter(re.findall(r"= \S+ ([a-z][a-z0-9-]*)\(", t)).items()))
        out[f"{name}-t{temp}"] = {"prefill": hist(pre), "run": hist(run)}
print(json.dumps(out))
