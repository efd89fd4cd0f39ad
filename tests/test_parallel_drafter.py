"""The parallel drafter (P-EAGLE): `drafter.draft_parallel` against the drafter run slot by slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.config import ConfigError, DrafterConfig
from eagle_jax.models import drafter

H, V, VD, MASK = 32, 64, 40, 5


def _dcfg(**kw):
    base = dict(hidden_size=H, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=V,
                draft_vocab_size=VD, target_hidden_size=24, aux_layer_ids=(0, 1, 2), mask_token_id=MASK)
    return DrafterConfig(**{**base, **kw})


draft_parallel = jax.jit(drafter.draft_parallel, static_argnums=(0, 6), static_argnames=("impl",))
call = jax.jit(lambda params, cfg, *args, **kwargs: drafter.Drafter(cfg, params)(*args, **kwargs),
               static_argnums=(1,))
head = jax.jit(lambda params, cfg, h: drafter.Drafter(cfg, params).head(h)[0], static_argnums=(1,))
project = jax.jit(lambda params, cfg, x: drafter.Drafter(cfg, params).project_features(x), static_argnums=(1,))


def _setup(dcfg, seed=0, b=2, ctx=5, t=3):
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.PRNGKey(seed), 5)
    params = drafter.init_params(dcfg, k1, scale=0.2)
    embed = 0.5 * jax.random.normal(k2, (V, H))
    vocab = drafter.DraftVocab.from_target_ids(np.sort(np.random.default_rng(seed).choice(V, VD, replace=False)), V)
    # a committed context of ctx entries per row, then t new ones
    ctx_aux = jax.random.normal(k3, (b, ctx, dcfg.fc_in_size))
    ctx_tok = jax.random.randint(k4, (b, ctx), 0, V)
    cache = drafter.create_cache(dcfg, b, ctx + t + 8)
    pos = jnp.broadcast_to(jnp.arange(ctx), (b, ctx))
    _, cache = call(params, dcfg, ctx_tok, project(params, dcfg, ctx_aux), pos, cache, embed=embed)
    cache = cache.commit(jnp.full((b,), ctx, jnp.int32))
    k6, k7 = jax.random.split(k5)
    aux = jax.random.normal(k6, (b, t, dcfg.fc_in_size))
    tok = jax.random.randint(k7, (b, t), 0, V)
    return params, embed, vocab, cache, tok, aux


def _slot_by_slot(dcfg, params, embed, cache, tok, aux, n, k):
    """Reference: the n real entries committed, then each placeholder as its own one-token
    step at the next position, committed before the next: [k, Vd] logits of one row (b=1)."""
    h, cache = call(params, dcfg, tok[:, :n], project(params, dcfg, aux[:, :n]),
                    cache.lengths[:, None] + jnp.arange(n)[None], cache, embed=embed)
    cache = cache.commit(jnp.array([n], jnp.int32))
    out = [head(params, dcfg, h[:, n - 1])]
    mask_h = project(params, dcfg, params["mask_hidden"][None, None])  # [1, 1, H]
    for _ in range(1, k):
        h, cache = call(params, dcfg, jnp.array([[MASK]]), mask_h, cache.lengths[:, None], cache, embed=embed)
        cache = cache.commit(jnp.array([1], jnp.int32))
        out.append(head(params, dcfg, h[:, 0]))
    return jnp.concatenate(out)


@pytest.mark.parametrize("variant", [dict(), dict(fc_norm=True, norm_output=True), dict(sliding_window=4)])
def test_parallel_equals_slot_by_slot(variant):
    """One forward over real entries + k-1 placeholders = the same slots run one by one, per row
    with its own count of real entries (the rest of the row's columns are never read)."""
    dcfg = _dcfg(**variant)
    params, embed, vocab, cache, tok, aux = _setup(dcfg)
    k = 4
    num_new = jnp.array([3, 1], jnp.int32)
    ids, logits, out_cache = draft_parallel(dcfg, params, vocab, tok, aux, cache, k, num_new=num_new, embed=embed)
    assert ids.shape == (2, k) and logits.shape == (2, k, VD) and logits.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out_cache.lengths), np.asarray(cache.lengths))  # nothing committed
    for row in range(2):
        n = int(num_new[row])
        one = cache.replace(k=cache.k[:, row:row + 1], v=cache.v[:, row:row + 1], lengths=cache.lengths[row:row + 1])
        want = _slot_by_slot(dcfg, params, embed, one, tok[row:row + 1], aux[row:row + 1], n, k)
        np.testing.assert_allclose(np.asarray(logits[row]), np.asarray(want), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(ids[row]), np.asarray(vocab.target_ids)[np.argmax(want, -1)])


def test_k1_is_the_ordinary_first_draft():
    """k = 1: exactly what sequential drafting proposes first, head(the root's output)."""
    dcfg = _dcfg(fc_norm=True, norm_output=True)
    params, embed, vocab, cache, tok, aux = _setup(dcfg, seed=1)
    ids, logits, _ = draft_parallel(dcfg, params, vocab, tok, aux, cache, 1, embed=embed)
    h, _ = call(params, dcfg, tok, project(params, dcfg, aux), cache.lengths[:, None] + jnp.arange(3)[None], cache,
                embed=embed)
    want = head(params, dcfg, h[:, -1])
    np.testing.assert_array_equal(np.asarray(logits[:, 0]), np.asarray(want))
    # and the placeholders after the root do not change the root's proposal (causal)
    _, logits5, _ = draft_parallel(dcfg, params, vocab, tok, aux, cache, 5, embed=embed)
    np.testing.assert_allclose(np.asarray(logits5[:, 0]), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_placeholder_inputs_matter():
    """Positions 2..k read mask_hidden and the placeholder id: changing either changes them, not token 1."""
    dcfg = _dcfg()
    params, embed, vocab, cache, tok, aux = _setup(dcfg, seed=2)
    _, base, _ = draft_parallel(dcfg, params, vocab, tok, aux, cache, 3, embed=embed)
    moved = dict(params, mask_hidden=params["mask_hidden"] + 1.0)
    _, got, _ = draft_parallel(dcfg, moved, vocab, tok, aux, cache, 3, embed=embed)
    np.testing.assert_array_equal(np.asarray(got[:, 0]), np.asarray(base[:, 0]))
    assert np.abs(np.asarray(got[:, 1:] - base[:, 1:])).max() > 1e-3
    _, got, _ = draft_parallel(dcfg.replace(mask_token_id=MASK + 1), params, vocab, tok, aux, cache, 3, embed=embed)
    assert np.abs(np.asarray(got[:, 1:] - base[:, 1:])).max() > 1e-3


def test_refusals():
    with pytest.raises(ConfigError, match="mask_token_id"):
        _dcfg(mask_token_id=V)
    with pytest.raises(ConfigError, match="mask_token_id"):
        _dcfg(mask_token_id=True)
    dcfg = _dcfg()
    params, embed, vocab, cache, tok, aux = _setup(dcfg)
    with pytest.raises(ValueError, match="parallel drafter"):
        drafter.draft_parallel(dcfg.replace(mask_token_id=None), params, vocab, tok, aux, cache, 2, embed=embed)
    with pytest.raises(ValueError, match="mask_hidden"):
        drafter.draft_parallel(dcfg, {k: v for k, v in params.items() if k != "mask_hidden"}, vocab, tok, aux,
                               cache, 2, embed=embed)
