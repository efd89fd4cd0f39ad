"""Training-time test (TTT): the drafter unrolled for L steps (EAGLE.md section 6).

Index arithmetic (sequence of tokens ``x_0 .. x_{T-1}``, right-padded, real
length ``n``; the target's aux features ``a_p`` and draft-vocab logits
``z_p`` at position ``p`` predict ``x_{p+1}``):

* The drafter works on *drafter positions* ``t = 0 .. T-1``; at inference its
  cache entry ``t`` pairs the target features of position ``t`` with the
  token ``x_{t+1}`` (``eagle_jax.spec.loop``).
* Step ``i`` (``0 <= i < L``) at drafter position ``t``:
    - hidden input: ``fc(a_t)`` for ``i = 0`` (``drafter.project_features``),
      else the feedback of step ``i-1`` at the same ``t`` (pre-norm for
      EAGLE-3, post-norm with ``norm_output``: ``drafter.step`` returns the
      right one);
    - input token ``x_{t+1+i}`` (teacher forcing; 0 when ``t+1+i >= T``);
    - RoPE position ``t + i``;
    - output: a prediction of ``x_{t+2+i}``, trained against the target's
      distribution for that same token, ``softmax(z_{t+1+i})`` (restricted to
      the draft vocab, i.e. renormalised over it).
  This is what chain drafting does: at step ``i`` of a draft rooted at
  drafter position ``t`` the token fed is the ``i``-th drafted token, at
  RoPE position ``t + i`` (``spec/tree.py``: level ``l`` at ``lengths + l - 1``).
* Loss weight of (step ``i``, position ``t``): ``loss_mask[t+2+i] == 1`` (the
  predicted token is a response token: train/data.py indexes the mask by the
  *label* position), ``t+2+i < T``, and the target's full-vocab argmax at
  ``t+1+i`` lies in the draft vocab (``in_vocab[t+1+i]``). Padding has
  ``loss_mask = 0``, so ``t+2+i < n`` follows. Hence only positions
  ``t < T-2-i`` can carry weight, and the comparison is made on slices:
  draft logits ``[:, :T-1-i]`` against target logits ``[:, 1+i:]``.
* Attention. Keys are (step ``j``, position ``t'``). A query (step ``i``,
  position ``t``) sees: step-0 keys with ``t' <= t`` and ``t' < n`` (causal,
  no padding keys); for ``1 <= j <= i`` only ``t' == t`` (the diagonal: the
  drafted tokens of the chain rooted at ``t``); nothing of later steps.
  Mapping onto ``drafter.step``: step ``i`` runs with a cache of
  ``(i+1)*T`` slots holding steps ``0..i-1`` in blocks of ``T`` and
  ``lengths = i*T`` (so its own K/V are written to the last block);
  ``slot_mask`` covers the earlier blocks (causal block, then diagonal
  blocks, then False for the block being written) and ``mask`` (among the new
  tokens) is causal&valid for step 0 and the identity for ``i >= 1``.
* Loss: ``sum_i 0.8**i * loss_i`` with ``loss_i`` the weighted mean over
  positions of ``-sum_v p_v log softmax(draft)_v``; top-1 accuracy per step:
  ``argmax(draft) == argmax(z_{t+1+i})`` over the same weights (equal to the
  full-vocab argmax since weighted positions have it in the draft vocab).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax.cache import KVCache
from eagle_jax.config import DrafterConfig
from eagle_jax.models import drafter

__all__ = ["step_masks", "dense_ttt_mask", "unroll", "ttt_loss", "shift_left"]


def shift_left(x: jax.Array, k: int, fill=0) -> jax.Array:
    """x [B, T, ...] -> y with y[:, t] = x[:, t + k] (fill past the end)."""
    if k == 0:
        return x
    pad = jnp.full((x.shape[0], k) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


def step_masks(valid: jax.Array, i: int) -> tuple[jax.Array, jax.Array]:
    """Attention masks of TTT step i, laid out for `drafter.step`.

    valid [B, T] bool (real tokens). Returns ``slot_mask [B, T, (i+1)*T]``
    over the cache slots (blocks of T: step 0, steps 1..i-1, then the block
    this step writes, always False) and ``mask [B, T, T]`` among this step's
    own keys (causal & valid for i = 0, identity otherwise).
    """
    b, t = valid.shape
    tril = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
    eye = jnp.broadcast_to(jnp.eye(t, dtype=bool)[None], (b, t, t))
    if i == 0:
        return jnp.zeros((b, t, t), bool), tril
    blocks = [tril] + [eye] * (i - 1) + [jnp.zeros((b, t, t), bool)]
    return jnp.concatenate(blocks, axis=2), eye


def dense_ttt_mask(valid: jax.Array, num_steps: int) -> jax.Array:
    """The whole TTT mask [B, L*T, L*T] (query (i, t) row i*T+t, key (j, t') column j*T+t')."""
    b, t = valid.shape
    rows = []
    for i in range(num_steps):
        slot, own = step_masks(valid, i)
        blocks = [slot[:, :, :i * t], own, jnp.zeros((b, t, (num_steps - 1 - i) * t), bool)]
        rows.append(jnp.concatenate(blocks, axis=2))
    return jnp.concatenate(rows, axis=1)


def unroll(dparams, dcfg: DrafterConfig, embed, aux, input_ids, lengths, num_steps: int, *,
           impl: str = "auto") -> list[jax.Array]:
    """Run the L TTT steps; returns the draft logits of each step, float32 [B, T, Vd].

    aux [B, T, A*Ht] target features (compute dtype), input_ids [B, T] int32,
    lengths [B] int32 real tokens per row. See the module docstring.
    """
    b, t = input_ids.shape
    if num_steps < 1 or num_steps > t - 2:
        raise ValueError(f"ttt length {num_steps} must be in [1, T-2] for T={t}")
    valid = jnp.arange(t, dtype=jnp.int32)[None] < lengths[:, None]
    hidden = drafter.project_features(dparams, dcfg, aux, impl=impl)
    dtype = hidden.dtype
    kv_shape = (1, b, dcfg.num_kv_heads, t, dcfg.head_dim)
    ks, vs, out = [], [], []
    for i in range(num_steps):
        tokens = shift_left(input_ids, 1 + i)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + i, (b, t))
        free = jnp.zeros(kv_shape, dtype)
        cache = KVCache(k=jnp.concatenate(ks + [free], axis=3), v=jnp.concatenate(vs + [free], axis=3),
                        lengths=jnp.full((b,), i * t, jnp.int32))
        slot_mask, mask = step_masks(valid, i)
        logits, hidden, cache = drafter.step(dparams, dcfg, tokens, hidden, positions, cache,
                                             embed=embed, mask=mask, slot_mask=slot_mask, impl=impl)
        ks.append(cache.k[:, :, :, i * t:])
        vs.append(cache.v[:, :, :, i * t:])
        out.append(logits)
    return out


def ttt_loss(draft_logits: list[jax.Array], target_logits, in_vocab, loss_mask, *,
             step_decay: float = 0.8):
    """Weighted soft cross-entropy over the TTT steps.

    draft_logits: L arrays [B, T, Vd]; target_logits [B, T, Vd] (target at
    position p, predicting x_{p+1}); in_vocab [B, T] bool; loss_mask [B, T]
    (1 = response token, indexed by label position). Returns (loss, metrics)
    with metrics ``loss_i``, ``acc_i``, ``count_i`` of shape [L].
    """
    t = target_logits.shape[1]
    lm = loss_mask.astype(jnp.float32)
    iv = in_vocab.astype(jnp.float32)
    total = 0.0
    losses, accs, counts = [], [], []
    for i, logits in enumerate(draft_logits):
        n = t - 1 - i  # drafter positions 0..n-1 have a target x_{t+1+i} row in range
        tgt = target_logits[:, 1 + i:].astype(jnp.float32)  # z_{t+1+i}
        lab = jnp.concatenate([lm[:, 2 + i:], jnp.zeros_like(lm[:, :1])], axis=1)  # mask[t+2+i]
        w = lab * iv[:, 1 + i:]
        d = logits[:, :n].astype(jnp.float32)
        p = jax.nn.softmax(tgt, axis=-1)
        ce = -jnp.sum(p * jax.nn.log_softmax(d, axis=-1), axis=-1)
        cnt = jnp.sum(w)
        denom = jnp.maximum(cnt, 1.0)
        loss_i = jnp.sum(ce * w) / denom
        hit = (jnp.argmax(d, -1) == jnp.argmax(tgt, -1)).astype(jnp.float32)
        accs.append(jnp.sum(hit * w) / denom)
        losses.append(loss_i)
        counts.append(cnt)
        total = total + (step_decay ** i) * loss_i
    return total, {"loss_i": jnp.stack(losses), "acc_i": jnp.stack(accs), "count_i": jnp.stack(counts)}
