"""Training-time test: masks, the unroll against plain drafter steps, loss index arithmetic."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.config import DrafterConfig
from eagle_jax.models import drafter
from eagle_jax.train import ttt

H, V, VD = 32, 64, 40

# Jitted once per config: eager mode would compile every primitive separately (slow).
unroll = jax.jit(ttt.unroll, static_argnums=(1, 6))
unroll_reference = jax.jit(ttt.unroll_reference, static_argnums=(1, 6))
step = jax.jit(lambda params, cfg, *args, **kwargs: drafter.Drafter(cfg, params).step(*args, **kwargs),
               static_argnums=(1,))


def _dcfg(**kw):
    base = dict(hidden_size=H, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
                vocab_size=V, draft_vocab_size=VD, target_hidden_size=24, aux_layer_ids=(0, 1, 2))
    base.update(kw)
    return DrafterConfig(**base)


def brute_force_mask(lengths, t, steps):
    """Query (i, q) may see key (j, k) iff j == 0 and k <= q and k < n, or 1 <= j <= i and k == q."""
    b = len(lengths)
    m = np.zeros((b, steps * t, steps * t), bool)
    for r, i, q, j, k in itertools.product(range(b), range(steps), range(t), range(steps), range(t)):
        if j == 0:
            ok = k <= q and k < lengths[r]
        else:
            ok = 1 <= j <= i and k == q
        m[r, i * t + q, j * t + k] = ok
    return m


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_mask_matches_brute_force(steps):
    t = 6
    lengths = np.array([6, 4, 0])
    valid = jnp.arange(t)[None] < jnp.asarray(lengths)[:, None]
    want = brute_force_mask(lengths, t, steps)
    np.testing.assert_array_equal(np.asarray(ttt.dense_ttt_mask(valid, steps)), want)
    for i in range(steps):
        slot, own = ttt.step_masks(valid, i)
        assert slot.shape == (3, t, (i + 1) * t) and own.shape == (3, t, t)
        rows = want[:, i * t:(i + 1) * t]
        np.testing.assert_array_equal(np.asarray(slot[:, :, :i * t]), rows[:, :, :i * t])
        np.testing.assert_array_equal(np.asarray(own), rows[:, :, i * t:(i + 1) * t])
        assert not np.asarray(slot[:, :, i * t:]).any()  # the block being written


def test_unroll_matches_plain_steps():
    """Step 0 = one plain causal Drafter.step; step i at position t = a chain rooted at t.

    (EAGLE-3 only: the 3.1 feedback is covered by test_fast_unroll_equals_reference, whose
    reference runs Drafter.step itself.)"""
    dcfg = _dcfg()
    key = jax.random.PRNGKey(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    params = drafter.init_params(dcfg, k1, scale=0.2)
    embed = 0.5 * jax.random.normal(k2, (V, H))
    b, t, steps = 2, 9, 3
    aux = jax.random.normal(k3, (b, t, dcfg.fc_in_size))
    ids = jax.random.randint(k4, (b, t), 0, V)
    lengths = jnp.array([9, 7], jnp.int32)
    got = unroll(params, dcfg, embed, aux, ids, lengths, steps)

    # Step 0: a plain causal step over the same inputs (token t+1, position t).
    hidden = drafter.Drafter(dcfg, params).project_features(aux)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    tok0 = ttt.shift_left(ids, 1)
    l0, fb0, _ = step(params, dcfg, tok0, hidden, pos, drafter.create_cache(dcfg, b, t), embed=embed)
    for row in range(b):  # padding queries differ: TTT hides padding keys, a plain causal step not
        n = int(lengths[row])
        np.testing.assert_allclose(np.asarray(got[0][row, :n]), np.asarray(l0[row, :n]), rtol=1e-5, atol=1e-5)

    # Steps >= 1: what chain drafting does at inference (spec_decode/tree.py), rooted at drafter
    # position r of row 0 (padding is irrelevant for row 0): the context cache holds the step-0
    # entries 0..r (written for all T positions, only r+1 committed: the rest is invisible and
    # overwritten); step i feeds token x_{r+1+i} at position r+i with the previous feedback and
    # sees the context plus its own chain.
    _, _, full_cache = step(params, dcfg, tok0[:1], hidden[:1], pos[:1], drafter.create_cache(dcfg, 1, t + steps),
                            embed=embed)
    for r in (0, 3, 5):
        cache = full_cache.replace(lengths=jnp.array([r + 1], jnp.int32))
        fb = fb0[:1, r:r + 1]
        for i in range(1, steps):
            tok = ids[:1, r + 1 + i:r + 2 + i]
            logits, fb, cache = step(params, dcfg, tok, fb, jnp.array([[r + i]]), cache, embed=embed)
            cache = cache.commit(jnp.array([1]))
            np.testing.assert_allclose(np.asarray(got[i][0, r]), np.asarray(logits[0, 0]),
                                       rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", [dict(), dict(fc_norm=True, norm_output=True),
                                     dict(norm_before_residual=True)])
def test_fast_unroll_equals_reference(variant):
    """The training path (diagonal attention) = Drafter.step under the dense TTT masks, grads too."""
    dcfg = _dcfg(**variant)
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(1), 4)
    params = drafter.init_params(dcfg, k1, scale=0.2)
    embed = 0.5 * jax.random.normal(k2, (V, H))
    b, t, steps = 3, 10, 4
    aux = jax.random.normal(k3, (b, t, dcfg.fc_in_size))
    ids = jax.random.randint(k4, (b, t), 0, V)
    lengths = jnp.array([10, 6, 0], jnp.int32)  # full, padded, empty row
    fast = unroll(params, dcfg, embed, aux, ids, lengths, steps)
    ref = unroll_reference(params, dcfg, embed, aux, ids, lengths, steps)
    for a, r in zip(fast, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-5)
    if variant:  # gradients once (compiling them is what costs time here)
        return

    def total(fn, p):
        outs = fn(p, dcfg, embed, aux, ids, lengths, steps)
        return sum(jnp.sum(jnp.sin(o)) for o in outs)

    g_fast = jax.jit(jax.grad(lambda p: total(ttt.unroll, p)))(params)
    g_ref = jax.jit(jax.grad(lambda p: total(ttt.unroll_reference, p)))(params)
    jax.tree.map(lambda a, r: np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-4),
                 g_fast, g_ref)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(g_fast))


def test_unroll_rejects_too_long_ttt():
    dcfg = _dcfg()
    params = drafter.init_params(dcfg, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="ttt length"):
        ttt.unroll(params, dcfg, jnp.zeros((V, H)), jnp.zeros((1, 4, dcfg.fc_in_size)),
                   jnp.zeros((1, 4), jnp.int32), jnp.array([4]), 3)


def test_loss_index_arithmetic_by_hand():
    """T = 6, L = 2, vocab 3. Row: tokens x0..x5, response = x3, x4, x5 (loss_mask[3:] = 1).

    Step 0 at drafter position t predicts x_{t+2} against target logits z_{t+1}:
      weighted t with loss_mask[t+2] = 1: t = 1, 2, 3 -> targets z2, z3, z4.
    Step 1 at t predicts x_{t+3} against z_{t+2}: weighted t = 0, 1, 2 -> z2, z3, z4.
    z4's argmax is marked outside the draft vocab, so (step 0, t=3) and (step 1, t=2) drop out.
    """
    t, vd = 6, 3
    z = np.full((1, t, vd), -9.0, np.float32)
    z[0, np.arange(t), np.arange(t) % vd] = 0.0  # z_p puts its mass on class p % 3
    in_vocab = np.ones((1, t), bool)
    in_vocab[0, 4] = False
    loss_mask = np.array([[0, 0, 0, 1, 1, 1]], np.int32)
    # draft logits: step 0 right at t = 1 (predicts class of z2 = 2), wrong at t = 2;
    # step 1 right at t = 0 and t = 1; anything at unweighted positions.
    d0 = np.zeros((1, t, vd), np.float32)
    d0[0, 1, 2] = 5.0  # step 0, t = 1 -> z2 -> class 2: right
    d0[0, 2, 1] = 5.0  # step 0, t = 2 -> z3 -> class 0: wrong
    d0[0, 0] = [9.0, 0.0, 0.0]  # unweighted
    d1 = np.zeros((1, t, vd), np.float32)
    d1[0, 0, 2] = 5.0  # step 1, t = 0 -> z2 -> class 2: right
    d1[0, 1, 0] = 5.0  # step 1, t = 1 -> z3 -> class 0: right
    d1[0, 4] = [0.0, 0.0, 9.0]  # unweighted
    loss, m = jax.jit(ttt.ttt_loss)([jnp.asarray(d0), jnp.asarray(d1)], jnp.asarray(z), jnp.asarray(in_vocab),
                           jnp.asarray(loss_mask), step_decay=0.8)
    np.testing.assert_array_equal(np.asarray(m["count_i"]), [2, 2])
    np.testing.assert_allclose(np.asarray(m["acc_i"]), [0.5, 1.0])

    def ce(p_logits, d_logits):
        p = np.exp(p_logits - p_logits.max())
        p /= p.sum()
        lq = d_logits - d_logits.max()
        lq = lq - np.log(np.exp(lq).sum())
        return -(p * lq).sum()

    l0 = (ce(z[0, 2], d0[0, 1]) + ce(z[0, 3], d0[0, 2])) / 2
    l1 = (ce(z[0, 2], d1[0, 0]) + ce(z[0, 3], d1[0, 1])) / 2
    np.testing.assert_allclose(np.asarray(m["loss_i"]), [l0, l1], rtol=1e-5)
    np.testing.assert_allclose(float(loss), l0 + 0.8 * l1, rtol=1e-5)


def test_hard_labels_are_the_target_argmax():
    """labels="hard": cross-entropy against the one-hot of argmax(z); same weights and accuracy as soft."""
    t, vd = 7, 6
    rng = np.random.default_rng(1)
    z = rng.normal(size=(2, t, vd)).astype(np.float32)
    d = [rng.normal(size=(2, t, vd)).astype(np.float32) for _ in range(2)]
    in_vocab = rng.random((2, t)) > 0.2
    lm = np.zeros((2, t), np.int32)
    lm[0, 3:] = 1
    lm[1, 2:6] = 1
    loss_fn = jax.jit(ttt.ttt_loss, static_argnames=("labels",))
    args = ([jnp.asarray(x) for x in d], jnp.asarray(z), jnp.asarray(in_vocab), jnp.asarray(lm))
    hard, mh = loss_fn(*args, labels="hard")
    soft, ms = loss_fn(*args, labels="soft")

    expect = []
    for i, di in enumerate(d):  # brute force over (row, drafter position)
        num = den = 0.0
        for r in range(2):
            for q in range(t - 2 - i):
                if lm[r, q + 2 + i] and in_vocab[r, q + 1 + i]:
                    logq = di[r, q] - np.log(np.exp(di[r, q] - di[r, q].max()).sum()) - di[r, q].max()
                    num += -logq[np.argmax(z[r, q + 1 + i])]
                    den += 1
        expect.append(num / den)
    np.testing.assert_allclose(np.asarray(mh["loss_i"]), expect, rtol=1e-5)
    np.testing.assert_allclose(float(hard), expect[0] + 0.8 * expect[1], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(mh["count_i"]), np.asarray(ms["count_i"]))
    np.testing.assert_allclose(np.asarray(mh["acc_i"]), np.asarray(ms["acc_i"]))
    assert abs(float(hard) - float(soft)) > 1e-3
    with pytest.raises(ValueError, match="labels must be one of"):
        ttt.ttt_loss(*args, labels="argmax")


def test_loss_ignores_padding_and_unmasked_rows():
    t, vd = 8, 5
    rng = np.random.default_rng(0)
    z = jnp.asarray(rng.normal(size=(2, t, vd)), jnp.float32)
    d = [jnp.asarray(rng.normal(size=(2, t, vd)), jnp.float32) for _ in range(3)]
    lm = np.zeros((2, t), np.int32)
    lm[0, 2:6] = 1  # row 0 length 6, right padding after; row 1 has no response tokens
    loss_fn = jax.jit(ttt.ttt_loss)
    _, m = loss_fn(d, z, jnp.ones((2, t), bool), jnp.asarray(lm))
    # step i weights t with 2 <= t + 2 + i <= 5, t >= 0: counts 4, 3, 2
    np.testing.assert_array_equal(np.asarray(m["count_i"]), [4, 3, 2])
    # Changing anything at unweighted places changes nothing.
    d2 = [x.at[1].set(0.0).at[0, 5:].set(3.0) for x in d]
    z2 = z.at[1].set(1.0).at[0, 7].set(2.0)
    l1, _ = loss_fn(d, z, jnp.ones((2, t), bool), jnp.asarray(lm))
    l2, _ = loss_fn(d2, z2, jnp.ones((2, t), bool), jnp.asarray(lm))
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)


def test_parallel_unroll_is_draft_parallel():
    """A parallel drafter's TTT step i at position r = slot i of `draft_parallel` rooted at r (the
    real entries 0..r, then the placeholders): training sees what inference computes. The fast
    path equals the dense reference, and the loss reaches mask_hidden."""
    dcfg = _dcfg(fc_norm=True, norm_output=True, mask_token_id=3)
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(4), 4)
    params = drafter.init_params(dcfg, k1, scale=0.2)
    embed = 0.5 * jax.random.normal(k2, (V, H))
    b, t, steps = 2, 9, 4
    aux = jax.random.normal(k3, (b, t, dcfg.fc_in_size))
    ids = jax.random.randint(k4, (b, t), 0, V)
    lengths = jnp.array([9, 6], jnp.int32)
    got = unroll(params, dcfg, embed, aux, ids, lengths, steps)
    ref = unroll_reference(params, dcfg, embed, aux, ids, lengths, steps)
    for a, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-5)
    vocab = drafter.DraftVocab.from_target_ids(np.arange(VD), V)
    parallel = jax.jit(drafter.draft_parallel, static_argnums=(0, 6))
    tok = ttt.shift_left(ids, 1)
    roots = [(0, 0), (0, 4), (1, 5)]  # (row, r): entries 0..r real, the rest of the row unread
    _, logits, _ = parallel(dcfg, params, vocab, tok[jnp.array([r for r, _ in roots])],
                            aux[jnp.array([r for r, _ in roots])], drafter.create_cache(dcfg, len(roots), t + steps),
                            steps, num_new=jnp.array([n + 1 for _, n in roots]), embed=embed)
    for j, (row, r) in enumerate(roots):
        for i in range(steps):
            np.testing.assert_allclose(np.asarray(got[i][row, r]), np.asarray(logits[j, i]), rtol=1e-4, atol=1e-4)
    grad = jax.jit(jax.grad(lambda p: sum(jnp.sum(jnp.sin(o)) for o in ttt.unroll(
        p, dcfg, embed, aux, ids, lengths, steps))))(params)
    assert float(jnp.abs(grad["mask_hidden"]).max()) > 0
