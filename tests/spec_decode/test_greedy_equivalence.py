"""Greedy speculative decoding must reproduce plain greedy decoding token for token."""

import jax
import pytest

from eagle_jax.config import SpecConfig
from eagle_jax.generate import Generator

from spec_helpers import random_prompts, smollm2_random_drafter, tiny_drafter, tiny_moe_target, tiny_target

CHAIN = SpecConfig("chain", num_speculative_tokens=4)
TREE = SpecConfig("tree", tree_top_k=3, tree_depth=4, tree_total_tokens=12)


@pytest.mark.parametrize("qwen3,variant,spec", [
    (False, "eagle3", CHAIN), (False, "eagle3.1", TREE), (True, "eagle3.1", CHAIN), (True, "eagle3", TREE)],
    ids=["llama-eagle3-chain", "llama-eagle31-tree", "qwen3-eagle31-chain", "qwen3-eagle3-tree"])
def test_tiny_targets_batch_and_single(qwen3, variant, spec):
    tcfg, tparams = tiny_target(vocab=8, qwen3=qwen3)
    d = tiny_drafter(tcfg, variant, draft_vocab=6)
    prompts = random_prompts(8, [13, 5, 9, 1, 20])
    max_new = [40, 33, 21, 40, 7]
    plain = Generator(tcfg, tparams).generate(prompts, max_new_tokens=max_new)
    gen = Generator(tcfg, tparams, drafter=d, spec=spec)
    spec_out = gen.generate(prompts, max_new_tokens=max_new)
    assert spec_out.token_ids == plain.token_ids
    assert [len(t) for t in spec_out.token_ids] == max_new
    # The tiny vocabulary makes random drafts right often enough that the acceptance
    # paths are exercised (a width-1 chain of a random drafter may still never hit).
    if spec.method == "tree" or not qwen3:
        assert spec_out.stats["accepted_tokens"] > 0
    single = gen.generate([prompts[2]], max_new_tokens=max_new[2])
    assert single.token_ids[0] == plain.token_ids[2]


def _speculative_equals_plain(tcfg, tparams, drafter, spec):
    """Two random prompts of a tiny target: greedy speculative decoding with `drafter` gives the
    plain greedy tokens, and some drafts were accepted."""
    import dataclasses

    prompts, max_new = random_prompts(8, [13, 5]), [24, 17]
    spec = dataclasses.replace(spec, disable_by_batch_size=None)
    plain = Generator(tcfg, tparams).generate(prompts, max_new_tokens=max_new)
    out = Generator(tcfg, tparams, drafter=drafter, spec=spec).generate(prompts, max_new_tokens=max_new)
    assert out.token_ids == plain.token_ids
    assert out.stats["accepted_tokens"] > 0


@pytest.mark.parametrize("kind,spec", [("deepseek", TREE), ("qwen3_moe", CHAIN)],
                         ids=["deepseek-tree", "qwen3_moe-chain"])
def test_moe_targets(kind, spec):
    """An MLA + MoE target (its compressed cache written, compacted along the accepted tree
    path and committed by the loop; on CPU the XLA impl) and a Qwen3-MoE target (the native
    kernels where they load), each with a random EAGLE 3.1 drafter made for it by
    train/initialize.py: greedy speculative decoding equals plain greedy decoding."""

    from eagle_jax.models.drafter import DraftVocab
    from eagle_jax.train.config import TrainConfig
    from eagle_jax.train.initialize import build_drafter_config, init_drafter_params

    tcfg, tparams = tiny_moe_target(kind)
    dcfg = build_drafter_config(tcfg, TrainConfig(variant="eagle3.1", draft_vocab_size=6))
    vocab = DraftVocab.from_target_ids(jax.numpy.arange(6), tcfg.vocab_size)
    dparams = init_drafter_params(dcfg, tcfg, tparams, vocab, jax.random.PRNGKey(1))
    _speculative_equals_plain(tcfg, tparams, (dcfg, dparams, vocab), spec)


def test_mla_drafter_on_an_mla_moe_target():
    """A random EAGLE 3.1 MLA drafter (vLLM's Eagle3DeepseekV2ForCausalLM layer: its latent
    cache drafted into under the tree mask, compacted along the accepted path and committed
    by the loop) on the tiny MLA + MoE target: greedy speculative decoding equals plain."""
    import dataclasses

    from eagle_jax.config import DrafterConfig
    from eagle_jax.models import drafter

    tcfg, tparams = tiny_moe_target("deepseek")
    dcfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_heads=2, num_kv_heads=2, head_dim=8,
                         vocab_size=tcfg.vocab_size, draft_vocab_size=6, target_hidden_size=tcfg.hidden_size,
                         aux_layer_ids=(1, 2, 3), rope=tcfg.rope, fc_norm=True, norm_output=True,
                         mla=dataclasses.replace(tcfg.mla, q_lora_rank=None, kv_lora_rank=12, norm_eps=1e-5))
    dparams = drafter.init_params(dcfg, jax.random.PRNGKey(1), scale=0.3)
    vocab = drafter.DraftVocab.from_target_ids(jax.numpy.arange(6), tcfg.vocab_size)
    _speculative_equals_plain(tcfg, tparams, (dcfg, dparams, vocab), TREE)


@pytest.mark.parametrize("variant,spec,batch", [
    ("eagle3", CHAIN, 1), pytest.param("eagle3.1", TREE, 1, marks=pytest.mark.slow),
    pytest.param("eagle3", TREE, 5, marks=pytest.mark.slow), ("eagle3.1", CHAIN, 5)],
    ids=["eagle3-chain-b1", "eagle31-tree-b1", "eagle3-tree-b5", "eagle31-chain-b5"])
def test_smollm2_random_drafter(smollm2_target, variant, spec, batch):
    texts = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers and explain why each one is prime, briefly.",
             "Hi", "Translate 'good morning' into Spanish, French and German."][:batch]
    plain = Generator(smollm2_target.cfg, smollm2_target.params, smollm2_target.tokenizer)
    d = smollm2_random_drafter(smollm2_target.cfg, variant)
    gen = Generator(smollm2_target.cfg, smollm2_target.params, smollm2_target.tokenizer, drafter=d, spec=spec)
    ref = plain.generate(texts, max_new_tokens=24)
    out = gen.generate(texts, max_new_tokens=24)
    assert out.token_ids == ref.token_ids
    assert out.stats["num_verify_steps"] > 0


@pytest.mark.parametrize("name", ["smollm2-135m-eagle3.1", pytest.param("smollm2-135m-eagle3", marks=pytest.mark.slow)])
def test_bundled_drafter_matches_plain(smollm2_target, name):
    """The shipped (trained) drafters load by name and keep greedy output exact."""
    from eagle_jax.convert.bundled import load_drafter_by_name

    d = load_drafter_by_name(name, smollm2_target.cfg, "smollm2-135m-instruct")
    texts = ["Write a Python function that returns the square of a number.", "What is 7 times 8?"]
    ref = Generator(smollm2_target.cfg, smollm2_target.params, smollm2_target.tokenizer).generate(texts, max_new_tokens=24)
    out = Generator(smollm2_target.cfg, smollm2_target.params, smollm2_target.tokenizer, drafter=d).generate(texts, max_new_tokens=24)
    assert out.token_ids == ref.token_ids
    assert out.stats["accepted_tokens"] > 0
