"""The decoding loop at the accelerator defaults, run on CPU: scanned layers
(`unroll_layers=False`) with the XLA kernels (GPU's `auto`) and with the
Pallas kernels in interpret mode (TPU's `auto`). Greedy speculative decoding
must reproduce plain greedy decoding of the same engine token for token; on
CPU fp32 both are deterministic, so the check is exact here (on a device the
device check, benchmarks/device_check.py, allows near-ties)."""

import pytest

from eagle_jax.config import SpecConfig
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
