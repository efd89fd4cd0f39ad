"""The decoding loop at the accelerator defaults, run on CPU: scanned layers
(`unroll_layers=False`) with the XLA kernels (GPU's `auto`) and with the
Pallas kernels in interpret mode (TPU's `auto`). Greedy speculative decoding
must reproduce plain greedy decoding of the same engine token for token; on
CPU fp32 both are deterministic, so the check is exact here (on a device the
device check, benchmarks/device_check.py, allows near-ties)."""

import pytest

from eagle_jax.config import SpecConfig
from eagle_jax.engine.batch import batch_inputs
from eagle_jax.generate import Generator

from spec_helpers import random_prompts, tiny_drafter, tiny_target

CHAIN = SpecConfig("chain", num_speculative_tokens=3)
TREE = SpecConfig("tree", tree_top_k=2, tree_depth=3, tree_total_tokens=6)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_scanned_layers_greedy_equivalence(impl, spec):
    tcfg, tparams = tiny_target(vocab=8)
    d = tiny_drafter(tcfg, "eagle3.1", draft_vocab=6)
    prompts = random_prompts(8, [9, 4])
    kw = dict(impl=impl, unroll_layers=False)
    plain = Generator(tcfg, tparams, **kw).generate(prompts, max_new_tokens=14)
    gen = Generator(tcfg, tparams, drafter=d, spec=spec, **kw)
    assert isinstance(gen.target_params["layers"], dict)  # stacked: the layers run under lax.scan
    out = gen.generate(prompts, max_new_tokens=14)
    assert out.token_ids == plain.token_ids
    assert out.stats["accepted_tokens"] > 0  # the tiny vocabulary makes random drafts hit


@pytest.mark.parametrize("unroll", [False, True], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_loop_copies_no_cache(spec, unroll):
    """With the XLA kernels the compiled decoding loop updates both KV caches in
    place: no `copy` of a buffer as large as the drafter's cache (the tree's
    scratch K/V live in that cache) or the target's; with scanned layers (the
    accelerator defaults) and unrolled ones (CPU without the native kernels,
    where reading the layers' old K/V beside one write of all of them after the
    last layer made XLA copy the target's K and V twice a step). Compiled by
    XLA:CPU, whose copy insertion is the pass GPU and TPU compilers share."""
    import math
    import re

    from eagle_jax.spec_decode import loop

    tcfg, tparams = tiny_target(vocab=8)
    d = tiny_drafter(tcfg, "eagle3.1", draft_vocab=6)
    gen = Generator(tcfg, tparams, drafter=d, spec=spec, impl="xla", unroll_layers=unroll)
    ids = gen.encode_prompts(random_prompts(8, [11]))
    lc, args, static = batch_inputs(gen, ids, gen.requests(len(ids), max_new_tokens=30))
    state = loop.prefill_jit(gen.target_params, gen.drafter_params, gen.vocab, *args, **static)
    hlo = loop.run_jit.lower(gen.target_params, gen.drafter_params, gen.vocab, state, lc=lc).compile().as_text()
    b, s = state.tcache.k.shape[1], state.tcache.k.shape[3]
    smallest = b * s * d[0].num_kv_heads * d[0].head_dim  # one drafter layer's K (or V)
    copies = [line.strip()[:160] for line in hlo.splitlines() if " copy(" in line
              and any(math.prod(int(n) for n in dims.split(",")) >= smallest
                      for dims in re.findall(r"\[([\d,]+)\]", line.split("=", 1)[1].split("copy(")[0]))]
    assert not copies, copies[:2]
    assert " while(" in hlo  # the decoding loop was compiled, so its body was searched
