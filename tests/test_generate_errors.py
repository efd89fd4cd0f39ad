"""Bad inputs to the Generator API fail early with a clear, specific error.

Every case here is rejected before anything is compiled, so the file runs in
seconds (the SmolLM2 target comes from the conversion cache).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from eagle_jax.config import ConfigError, DrafterConfig, SpecConfig
from eagle_jax.generate import Generator, PromptError
from eagle_jax.models.drafter import DraftVocab, init_params


@pytest.fixture(scope="module")
def gen(smollm2_target):
    t = smollm2_target
    return Generator(t.cfg, t.params, t.tokenizer)


# ----------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("prompt, match", [
    ("", r"prompt 0 is empty"),
    ([], r"no prompts given"),
    ([[]], r"prompt 0 is empty"),
    (["fine", ""], r"prompt 1 is empty"),
])
def test_empty_prompt(gen, prompt, match):
    with pytest.raises(PromptError, match=match):
        gen.generate(prompt, max_new_tokens=4)


def test_empty_prompt_without_chat(gen):
    with pytest.raises(PromptError, match=r"prompt 0 is empty"):
        gen.generate("", chat=False, max_new_tokens=4)


@pytest.mark.parametrize("bad", [49152, 10 ** 9, -1])
def test_token_id_outside_vocabulary(gen, bad):
    with pytest.raises(PromptError, match=rf"prompt 0: token id {bad} outside the vocabulary "
                                          r"\[0, 49152\)"):
        gen.generate([[1, 2, bad, 3]], max_new_tokens=4)


def test_token_id_error_names_the_row(gen):
    with pytest.raises(PromptError, match=r"prompt 1: token id 50000 outside"):
        gen.generate([[1, 2, 3], [4, 50000]], max_new_tokens=4)


def test_prompt_longer_than_the_context(smollm2_target):
    t = smollm2_target
    small = Generator(t.cfg, t.params, t.tokenizer, context_limit=16)
    n = len(t.tokenizer.apply_chat("What is the capital of France?"))
    assert n > 16
    with pytest.raises(PromptError, match=rf"prompt 0 has {n} tokens; the context holds 16"):
        small.generate("What is the capital of France?", max_new_tokens=4)
    # a prompt that exactly fills the context leaves no room for one new token
    with pytest.raises(PromptError, match=r"prompt 0 has 16 tokens; the context holds 16, "
                                          r"leaving no room to generate"):
        small.generate([list(range(1, 17))], max_new_tokens=4)


def test_context_limit_is_capped_by_the_model(smollm2_target):
    t = smollm2_target
    g = Generator(t.cfg, t.params, t.tokenizer, context_limit=10 ** 6)
    assert g.context_limit == t.cfg.max_position_embeddings


def test_string_prompt_needs_a_tokenizer(smollm2_target):
    t = smollm2_target
    with pytest.raises(PromptError, match=r"no tokenizer: pass token ids"):
        Generator(t.cfg, t.params, None).generate("hello", max_new_tokens=4)


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-1.0), r"temperature must be >= 0, got -1.0"),
    (dict(temperature=float("nan")), r"temperature must be >= 0, got nan"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_p=-0.1), r"top_p must be in \(0, 1\], got -0.1"),
    (dict(top_k=-1), r"top_k must be a non-negative integer, got -1"),
    (dict(top_k=2.5), r"top_k must be a non-negative integer, got 2.5"),
])
def test_invalid_sampling_parameters(gen, kw, match):
    with pytest.raises(ConfigError, match=match):
        gen.generate("hello", max_new_tokens=4, **kw)


@pytest.mark.parametrize("max_new", [0, -3, [4, 0], [4], [4, 4, 4], [4, 2.0]])
def test_invalid_max_new_tokens(gen, max_new):
    with pytest.raises(PromptError, match=r"max_new_tokens must be a positive int or one per prompt"):
        gen.generate(["hello", "world"], max_new_tokens=max_new)


# ----------------------------------------------------------------------------- speculative config


@pytest.mark.parametrize("method", ["beam", "Chain", ""])
def test_unknown_method(method):
    with pytest.raises(ConfigError, match=rf"method must be 'chain' or 'tree', got '{method}'"):
        SpecConfig(method=method)


def test_chain_needs_a_drafted_token():
    with pytest.raises(ConfigError, match=r"num_speculative_tokens must be >= 1, got 0"):
        SpecConfig(method="chain", num_speculative_tokens=0)


@pytest.mark.parametrize("k, d, n, most", [
    (2, 2, 100, 7),  # 2 + 1*2*2 = 6 nodes + root
    (4, 4, 54, 53),  # 4 + 3*16 = 52 + root
    (1, 3, 5, 4),  # a chain-shaped tree holds depth + root
])
def test_impossible_tree_envelope(k, d, n, most):
    with pytest.raises(ConfigError, match=rf"tree_total_tokens must be in \[2, {most}\] for "
                                          rf"top_k={k}, depth={d}, got {n}"):
        SpecConfig(method="tree", tree_top_k=k, tree_depth=d, tree_total_tokens=n)


def test_largest_tree_envelope_is_accepted():
    assert SpecConfig(method="tree", tree_top_k=2, tree_depth=2, tree_total_tokens=7).total_tokens == 7


def test_shallower_drafts_keep_the_envelope():
    chain = SpecConfig("chain", num_speculative_tokens=3)
    tree = SpecConfig("tree", tree_top_k=4, tree_depth=3, tree_total_tokens=12)
    assert chain.at_depth(1).total_tokens == 2 and chain.at_depth(3) == chain
    # A one-level tree holds the root and its 4 children; deeper ones keep the 12 tokens.
    assert [(tree.at_depth(d).depth, tree.at_depth(d).total_tokens) for d in (1, 2, 3)] == [(1, 5), (2, 12), (3, 12)]
    for bad in (0, 4):
        with pytest.raises(ConfigError, match=rf"a draft depth must be in \[1, 3\], got {bad}"):
            tree.at_depth(bad)


@pytest.mark.parametrize("kw", [dict(tree_top_k=0), dict(tree_depth=0)])
def test_tree_needs_width_and_depth(kw):
    with pytest.raises(ConfigError, match=r"tree_top_k and tree_depth must be >= 1"):
        SpecConfig(method="tree", **kw)


# ----------------------------------------------------------------------------- drafter vs target


def _drafter(vocab: int, target_hidden: int):
    """A drafter for another target; the checks never read the weights, so they are zeros
    of the right shapes (no random-number kernels to compile)."""
    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_heads=2, num_kv_heads=1,
                        head_dim=16, vocab_size=vocab, draft_vocab_size=vocab,
                        target_hidden_size=target_hidden, aux_layer_ids=(2, 15, 27))
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)
    return cfg, params, DraftVocab.identity(vocab)


def test_drafter_vocab_mismatch(smollm2_target):
    t = smollm2_target
    with pytest.raises(ValueError, match=r"drafter vocab_size 32000 != target vocab_size 49152: "
                                         r"the drafter was trained for another target"):
        Generator(t.cfg, t.params, t.tokenizer, drafter=_drafter(32000, t.cfg.hidden_size))


def test_drafter_hidden_size_mismatch(smollm2_target):
    t = smollm2_target
    with pytest.raises(ValueError, match=r"drafter target_hidden_size 4096 != target hidden_size 576"):
        Generator(t.cfg, t.params, t.tokenizer, drafter=_drafter(t.cfg.vocab_size, 4096))


def test_mismatched_drafter_checkpoint_is_refused_on_load(smollm2_target, tmp_path):
    """The same mismatch caught when a saved drafter is loaded for this target."""
    from eagle_jax.convert.drafter_formats import load_drafter, save_drafter

    cfg, params, vocab = _drafter(32000, 576)
    save_drafter(tmp_path / "d", cfg, params, vocab, format="speculators")
    with pytest.raises(ConfigError, match=r"vocab_size 32000 of the drafter differs from the "
                                          r"target's 49152"):
        load_drafter(tmp_path / "d", target_cfg=smollm2_target.cfg)


@pytest.mark.parametrize("stop, match", [
    ([["a"], ["b"], ["c"]], r"3 stop lists for 2 prompts"),
    ([1, 2], r"stop must be strings"),
])
def test_bad_stop_lists(gen, stop, match):
    with pytest.raises(PromptError, match=match):
        gen.generate(["one", "two"], max_new_tokens=4, stop=stop)
    with pytest.raises(PromptError, match=r"stop must be strings"):
        gen.stream("one", max_new_tokens=4, stop=[3])
