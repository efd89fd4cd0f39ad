"""Greedy speculative == plain on the native CPU path (kernels/cpu), at each dtype.

fp32: token for token, at head_dim 64 (the native attention's shapes) with a
tiny random target, chain and tree, batch 1 and 3, and with SmolLM2 and its
bundled drafter. bf16: equal except where plain decoding itself stood at a
near-tie: at the first differing position the target's top-2 logits (plain
engine, teacher-forced on the common prefix) must be within `BF16_GAP`.
"""

import jax
import jax.numpy as jnp
import pytest

from eagle_jax.config import SpecConfig, TargetConfig
from eagle_jax.engine.batch import batch_inputs
from eagle_jax.generate import Generator
from eagle_jax.kernels import cpu
from eagle_jax.models import target

from spec_helpers import random_prompts, smollm2_random_drafter

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"native kernels: {cpu.unavailable_reason()}")

CHAIN = SpecConfig("chain", num_speculative_tokens=4)
TREE = SpecConfig("tree", tree_top_k=3, tree_depth=3, tree_total_tokens=10)
# bf16 logits of a 576-wide model are ~1e1; bf16 rounding of the hidden states
# moves them by a few 1e-2. A divergence is a near-tie when the top-2 gap is below this.
BF16_GAP = 0.25


def native_target(dtype=jnp.float32):
    """A small Llama with head_dim 64 (the shape the native attention takes) and a tiny vocabulary."""
    cfg = TargetConfig(vocab_size=8, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5)
    return cfg, target.init_params(cfg, jax.random.PRNGKey(0), scale=0.3, dtype=dtype)


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_fp32_exact_at_head_dim_64(spec):
    tcfg, tparams = native_target()
    d = smollm2_random_drafter(tcfg, "eagle3.1", draft_vocab=6, scale=0.3)
    prompts = random_prompts(8, [11, 4, 23])
    plain = Generator(tcfg, tparams, impl="native").generate(prompts, max_new_tokens=30)
    gen = Generator(tcfg, tparams, drafter=d, spec=spec, impl="native")
    out = gen.generate(prompts, max_new_tokens=30)
    assert out.token_ids == plain.token_ids
    assert gen.generate([prompts[1]], max_new_tokens=30).token_ids[0] == plain.token_ids[1]
    assert out.stats["accepted_tokens"] > 0  # the tiny vocabulary makes random drafts hit: paths are compacted


def _first_gap(gen, prompt_ids, ours, ref):
    """(position, top-2 logit gap of the plain engine there) where two continuations part; None if equal."""
    j = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if j is None:
        return None
    ids = jnp.asarray([prompt_ids + ref[:j]], jnp.int32)
    cache = target.create_cache(gen.target_cfg, 1, ids.shape[1] + 8, gen.target_params["embed"].dtype)
    pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    model = target.Target(gen.target_cfg, gen.target_params)
    h, _, _ = model(ids, pos, cache, impl=gen.impl)
    top = jax.lax.top_k(model.logits(h[:, -1], impl=gen.impl), 2)[0][0]
    return j, float(top[0] - top[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_bundled_drafter_native(dtype):
    texts = ["Write a Python function that returns the list of prime numbers below n.",
             "Explain what a KV cache is in two sentences."]
    plain = Generator.load("smollm2-135m-instruct", draft=None, dtype=dtype, impl="native")
    ref = plain.generate(texts, max_new_tokens=40)
    prompt_ids = plain.encode_prompts(texts)
    for spec in (CHAIN, SpecConfig("tree")):
        gen = Generator.load("smollm2-135m-instruct", draft="default", dtype=dtype, spec=spec, impl="native")
        out = gen.generate(texts, max_new_tokens=40)
        assert out.stats["accepted_tokens"] > 0
        for p, ours, theirs in zip(prompt_ids, out.token_ids, ref.token_ids):
            if dtype == "float32":
                assert ours == theirs
            else:
                gap = _first_gap(plain, p, ours, theirs)
                assert gap is None or gap[1] < BF16_GAP, f"diverged at {gap[0]} with top-2 gap {gap[1]:.3g}"


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_the_decoding_loop_copies_no_cache(spec):
    """The compiled loop threads both KV caches through in-place kernel calls:
    no `copy` of a cache-sized buffer (the drafted K/V are scratch in the
    drafter cache, which the roll-forward then overwrites)."""
    from eagle_jax.spec_decode import loop

    tcfg, tparams = native_target()
    d = smollm2_random_drafter(tcfg, "eagle3.1", draft_vocab=6, scale=0.3)
    gen = Generator(tcfg, tparams, drafter=d, spec=spec, impl="native")
    ids = gen.encode_prompts(random_prompts(8, [11]))
    lc, args, static = batch_inputs(gen, ids, gen.requests(len(ids), max_new_tokens=30))
    state = loop.prefill_jit(gen.target_params, gen.drafter_params, gen.vocab, *args, **static)
    hlo = loop.run_jit.lower(gen.target_params, gen.drafter_params, gen.vocab, state, lc=lc).compile().as_text()
    shapes = {str(state.tcache.k.shape), str(state.dcache.k.shape)}
    copies = [line for line in hlo.splitlines() if " copy(" in line
              and any(f"[{s[1:-1].replace(' ', '')}]" in line.split("=")[1].split("copy(")[0] for s in shapes)]
    assert not copies, copies[:2]
