"""Models give the same logits with the XLA path and the Pallas kernels (interpret mode)."""

import jax
import jax.numpy as jnp
import pytest

from eagle_jax.config import DrafterConfig, TargetConfig
from eagle_jax.models import drafter, target


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_target_logits_xla_vs_interpret(qkv_bias):
    cfg = TargetConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, max_position_embeddings=64, qkv_bias=qkv_bias,
                       tie_word_embeddings=True)
    params = target.init_params(cfg, jax.random.PRNGKey(0), scale=0.2)
    toks = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 0, 300)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    out = {}
    for impl in ("xla", "interpret"):
        model = target.Target(cfg, params)
        h, _, aux = model(toks, pos, target.create_cache(cfg, 2, 16),
                                   aux_layers=(0, 1), impl=impl)
        out[impl] = (model.logits(h, impl=impl), aux)
    assert rel(out["interpret"][0], out["xla"][0]) < 1e-5
    assert rel(out["interpret"][1], out["xla"][1]) < 1e-5


@pytest.mark.parametrize("flags", [{}, {"fc_norm": True, "norm_output": True}, {"norm_before_fc": True}],
                         ids=["eagle3", "eagle3.1", "norm_before_fc"])
def test_drafter_logits_xla_vs_interpret(flags):
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
                        vocab_size=300, draft_vocab_size=200, target_hidden_size=48, aux_layer_ids=(0, 1, 2),
                        **flags)
    params = drafter.init_params(cfg, jax.random.PRNGKey(0), scale=0.2)
    embed = jax.random.normal(jax.random.PRNGKey(3), (300, 64))
    aux = 3.0 * jax.random.normal(jax.random.PRNGKey(1), (2, 5, 144))
    toks = jax.random.randint(jax.random.PRNGKey(2), (2, 5), 0, 300)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    out = {}
    for impl in ("xla", "interpret"):
        model = drafter.Drafter(cfg, params)
        h = model.project_features(aux, impl=impl)
        logits, fb, _ = model.step(toks, h, pos, drafter.create_cache(cfg, 2, 8),
                                     embed=embed, impl=impl)
        out[impl] = (logits, fb)
    assert rel(out["interpret"][0], out["xla"][0]) < 1e-5
    assert rel(out["interpret"][1], out["xla"][1]) < 1e-5
