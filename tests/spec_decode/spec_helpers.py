"""Tiny random targets and drafters for engine tests (imported by tests/spec_decode/*)."""

import dataclasses

import jax
import jax.numpy as jnp
from eagle_jax.config import DrafterConfig, MLAConfig, MoEConfig, RopeConfig, TargetConfig
from eagle_jax.models import drafter, target


def tiny_target(vocab=8, qwen3=False, seed=0, scale=0.3, eos=()):
    cfg = TargetConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=4,
                       num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512,
                       qk_norm=qwen3, architecture="Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM",
                       model_type="qwen3" if qwen3 else "llama", eos_token_ids=tuple(eos))
    return cfg, target.init_params(cfg, jax.random.PRNGKey(seed), scale=scale)


def tiny_moe_target(kind, vocab=8, seed=0, scale=0.3):
    """A tiny random MoE target: "deepseek" (MLA, YaRN, grouped sigmoid routing, a shared
    expert, the first layer dense) or "qwen3_moe" (GQA with q/k norms, softmax routing,
    layer 2 dense)."""
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                  head_dim=8, max_position_embeddings=512)
    if kind == "deepseek":
        cfg = TargetConfig(**common, num_kv_heads=4, architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3",
                           rope=RopeConfig(scaling_type="yarn", factor=4.0, original_max_position_embeddings=16),
                           moe=MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=16, layers=(1, 2, 3),
                                         scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                                         num_groups=4, topk_groups=2, num_shared_experts=1),
                           mla=MLAConfig(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                         v_head_dim=8, mscale_all_dim=1.0))
    else:
        cfg = TargetConfig(**common, num_kv_heads=2, qk_norm=True, architecture="Qwen3MoeForCausalLM",
                           model_type="qwen3_moe",
                           moe=MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=16, layers=(0, 1, 3),
                                         norm_topk_prob=True))
    return cfg, target.init_params(cfg, jax.random.PRNGKey(seed), scale=scale)


def tiny_drafter(tcfg, variant="eagle3", draft_vocab=None, seed=1, scale=0.3):
    flags = {"eagle3": {}, "eagle3.1": dict(fc_norm=True, norm_output=True)}[variant]
    v = tcfg.vocab_size
    vd = draft_vocab or v
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
                        vocab_size=v, draft_vocab_size=vd, target_hidden_size=tcfg.hidden_size,
                        aux_layer_ids=(1, 2, 3), rope=tcfg.rope, **flags)
    params = drafter.init_params(cfg, jax.random.PRNGKey(seed), scale=scale)
    ids = jnp.sort(jax.random.permutation(jax.random.PRNGKey(seed + 7), v)[:vd])
    return cfg, params, drafter.DraftVocab.from_target_ids(ids, v)


def random_prompts(vocab, lengths, seed=3):
    key = jax.random.PRNGKey(seed)
    return [jax.random.randint(jax.random.fold_in(key, i), (n,), 0, vocab).tolist()
            for i, n in enumerate(lengths)]


def smollm2_random_drafter(tcfg, variant, draft_vocab=4096, seed=11, scale=0.02):
    """A random drafter shaped like the target's layers (any target config)."""
    flags = {"eagle3": {}, "eagle3.1": dict(fc_norm=True, norm_output=True)}[variant]
    cfg = DrafterConfig(hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
                        num_heads=tcfg.num_heads, num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim,
                        vocab_size=tcfg.vocab_size, draft_vocab_size=draft_vocab,
                        target_hidden_size=tcfg.hidden_size, aux_layer_ids=tcfg.default_aux_layers(),
                        rope=tcfg.rope, rms_norm_eps=tcfg.rms_norm_eps,
                        max_position_embeddings=tcfg.max_position_embeddings, **flags)
    params = drafter.init_params(cfg, jax.random.PRNGKey(seed), scale=scale)
    ids = jnp.sort(jax.random.permutation(jax.random.PRNGKey(seed + 1), tcfg.vocab_size)[:draft_vocab])
    return cfg, params, drafter.DraftVocab.from_target_ids(ids, tcfg.vocab_size)


def word_tokenizer(vocab: int):
    """A word-level tokenizer of a tiny target's tokens ("t0" .. "t<vocab-1>"): engines stream text."""
    from tokenizers import Tokenizer as Tokens, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from eagle_jax.tokenizer import Tokenizer

    tokens = Tokens(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokens.pre_tokenizer, tokens.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=tokens))


def with_eos(cfg, eos):
    return dataclasses.replace(cfg, eos_token_ids=tuple(eos))
