"""Training-time test (TTT): the drafter unrolled for L steps (EAGLE.md section 6).

Index arithmetic (sequence of tokens ``x_0 .. x_{T-1}``, right-padded, real
length ``n``; the target's aux features ``a_p`` and draft-vocab logits
``z_p`` at position ``p`` predict ``x_{p+1}``):

* The drafter works on *drafter positions* ``t = 0 .. T-1``; at inference its
  cache entry ``t`` pairs the target features of position ``t`` with the
  token ``x_{t+1}`` (``eagle_jax.spec_decode.loop``).
* Step ``i`` (``0 <= i < L``) at drafter position ``t``:
    - hidden input: ``fc(a_t)`` for ``i = 0`` (``Drafter.project_features``),
      else the feedback of step ``i-1`` at the same ``t`` (pre-norm for
      EAGLE-3, post-norm with ``norm_output``: ``Drafter.step`` returns the
      right one);
    - input token ``x_{t+1+i}`` (teacher forcing; 0 when ``t+1+i >= T``);
    - RoPE position ``t + i``;
    - output: a prediction of ``x_{t+2+i}``, trained against the target's
      distribution for that same token, ``softmax(z_{t+1+i})`` (restricted to
      the draft vocab, i.e. renormalised over it).
  This is what chain drafting does: at step ``i`` of a draft rooted at
  drafter position ``t`` the token fed is the ``i``-th drafted token, at
  RoPE position ``t + i`` (``spec_decode/tree.py``: level ``l`` at ``lengths + l - 1``).
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
  Mapping onto ``Drafter.step`` (:func:`unroll_reference`): step ``i`` runs with a cache of
  ``(i+1)*T`` slots holding steps ``0..i-1`` in blocks of ``T`` and
  ``lengths = i*T`` (so its own K/V are written to the last block);
  ``slot_mask`` covers the earlier blocks (causal block, then diagonal
  blocks, then False for the block being written) and ``mask`` (among the new
  tokens) is causal&valid for step 0 and the identity for ``i >= 1``.
  :func:`unroll` (used for training) computes the same thing without the
  dense masks: one causal [T, T] score block against the step-0 keys plus
  ``i`` per-position dot products against the diagonal keys.
* Parallel drafter (P-EAGLE, ``dcfg.mask_token_id`` set): steps ``i >= 1`` feed
  the placeholder instead (token ``mask_token_id``, hidden
  ``project_features(mask_hidden)``, no feedback), at the same RoPE position
  ``t + i``, under the same mask, against the same target ``z_{t+1+i}``: what
  ``models.drafter.draft_parallel`` computes for a chain rooted at ``t`` (step ``i``
  at ``t`` is its slot ``i``; the P-EAGLE training mask, "depth-0 keys of anchors
  <= mine, and my anchor's keys of depths <= mine", is this mask). Every anchor
  trains every depth (speculators' COD sampling would keep a shrinking share of
  anchors per depth, to save memory on long sequences).
* Loss: ``sum_i 0.8**i * loss_i`` with ``loss_i`` the weighted mean over
  positions of ``-sum_v p_v log softmax(draft)_v``, ``p`` the restricted
  target distribution (``labels="soft"``, EAGLE-3's choice) or the one-hot of
  its argmax (``labels="hard"``, EAGLE-1/2 style); top-1 accuracy per step:
  ``argmax(draft) == argmax(z_{t+1+i})`` over the same weights (equal to the
  full-vocab argmax since weighted positions have it in the draft vocab).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from eagle_jax.cache import KVCache
from eagle_jax.config import DrafterConfig
from eagle_jax.kernels import ops
from eagle_jax.models import drafter
from eagle_jax.models.layers import rotated_heads

__all__ = ["LABELS", "step_masks", "dense_ttt_mask", "unroll", "unroll_reference", "ttt_loss", "shift_left"]


def shift_left(x: jax.Array, k: int, fill=0) -> jax.Array:
    """x [B, T, ...] -> y with y[:, t] = x[:, t + k] (fill past the end)."""
    if k == 0:
        return x
    pad = jnp.full((x.shape[0], k) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


def step_masks(valid: jax.Array, i: int) -> tuple[jax.Array, jax.Array]:
    """Attention masks of TTT step i, laid out for `Drafter.step`.

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

    `input_ids` is the UNSHIFTED sequence: ``aux[:, t]`` and ``input_ids[:, t]``
    belong to the same position t, and step i pairs the features at t with
    token ``t + 1 + i`` (shifted here). speculators' ``Eagle3DraftModel.forward``
    instead takes a batch its collator already shifted (its ``input_ids[t]`` is
    the token after ``hidden_states[t]``), as ``Drafter.step`` does: pass
    ``input_ids[:, 1:]`` there for the same pairing.

    This is the fast path used for training: the drafter layer of
    ``Drafter.step`` with an attention that scores each query against the
    step-0 keys (one [T, T] causal block) plus its ``i`` diagonal keys (one dot
    product each), instead of against ``(i+1)*T`` cache slots under a dense
    mask. :func:`unroll_reference` is the same computation through
    ``Drafter.step`` and :func:`step_masks`; the tests hold the two equal.
    """
    if dcfg.mla is not None:
        raise ValueError("training an MLA drafter is not implemented: the TTT attention takes per-head K/V")
    b, t = input_ids.shape
    _check_length(num_steps, t)
    valid = jnp.arange(t, dtype=jnp.int32)[None] < lengths[:, None]
    mask0 = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]  # [B, T, T] step-0 keys
    model = drafter.Drafter(dcfg, dparams)
    hidden = model.project_features(aux, impl=impl)
    k0 = v0 = None
    dk, dv, out = [], [], []
    for i in range(num_steps):
        tokens = _step_tokens(dcfg, input_ids, i)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + i, (b, t))

        def attend(qkv, cos, sin, i=i):
            q, k, v = rotated_heads(dcfg, qkv, cos, sin)
            if i == 0:
                return _ttt_attention(q, k, v, mask0, [], []), (k, v)
            return _ttt_attention(q, k0, v0, mask0, dk + [k], dv + [v]), (k, v)

        h, (k, v) = model.layer_forward(tokens, hidden, positions, attend, embed=embed, impl=impl)
        logits, feedback = model.head(h, impl=impl)
        hidden = _next_hidden(model, feedback, impl)
        if i == 0:
            k0, v0 = k, v
        else:
            dk.append(k)
            dv.append(v)
        out.append(logits)
    return out


def _step_tokens(dcfg: DrafterConfig, input_ids, i: int) -> jax.Array:
    """[B, T] input tokens of step i: x_{t+1+i}, or the placeholder at steps >= 1 of a parallel drafter."""
    if i == 0 or not dcfg.parallel_drafting:
        return shift_left(input_ids, 1 + i)
    return jnp.full_like(input_ids, dcfg.mask_token_id)


def _next_hidden(model: drafter.Drafter, feedback, impl: str) -> jax.Array:
    """The hidden input of the next step [B, T, H]: the feedback, or a parallel drafter's placeholder."""
    if not model.cfg.parallel_drafting:
        return feedback
    mask = model.mask_hidden.get_value().astype(feedback.dtype)
    return jnp.broadcast_to(model.project_features(mask[None, None], impl=impl), feedback.shape)


def _check_length(num_steps: int, t: int) -> None:
    if num_steps < 1 or num_steps > t - 2:
        raise ValueError(f"ttt length {num_steps} must be in [1, T-2] for T={t}")


def _ttt_attention(q, k0, v0, mask0, diag_k, diag_v):
    """Softmax attention over the step-0 keys (under mask0) plus per-position diagonal keys.

    q [B, T, Hq, D]; k0/v0 [B, T, Hkv, D]; mask0 [B, T, T]; diag_k/diag_v:
    lists of [B, T, Hkv, D] whose entry at t is a key only for query t.
    Float32 scores and softmax; a query that sees nothing returns 0.
    Returns [B, T, Hq*D] in q.dtype.
    """
    b, t, hq, d = q.shape
    hkv = k0.shape[2]
    g = hq // hkv
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    qh = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, g, T, D]
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # [B, T, Hkv, D] -> [B, Hkv, T, D]
    m0 = mask0[:, None, None]  # [B, 1, 1, T, T]
    s0 = jnp.einsum("bhgqd,bhkd->bhgqk", qh, heads_first(k0), preferred_element_type=jnp.float32) * scale
    s0 = jnp.where(m0, s0, -jnp.inf)
    peak = jnp.max(s0, axis=-1)
    sd = None
    if diag_k:
        sd = jnp.stack([jnp.einsum("bhgqd,bhqd->bhgq", qh, heads_first(kj), preferred_element_type=jnp.float32)
                        for kj in diag_k], axis=-1) * scale  # [B, Hkv, g, T, i]
        peak = jnp.maximum(peak, jnp.max(sd, axis=-1))
    peak = jax.lax.stop_gradient(jnp.where(jnp.isfinite(peak), peak, 0.0))[..., None]
    w0 = jnp.where(m0, jnp.exp(s0 - peak), 0.0)
    denom = jnp.sum(w0, axis=-1)
    if sd is not None:
        wd = jnp.exp(sd - peak)
        denom = denom + jnp.sum(wd, axis=-1)
    inv = (1.0 / jnp.where(denom > 0, denom, 1.0))[..., None]
    vdt = v0.dtype
    out = jnp.einsum("bhgqk,bhkd->bhgqd", (w0 * inv).astype(vdt), heads_first(v0),
                     preferred_element_type=jnp.float32)
    for j, vj in enumerate(diag_v):
        out = out + (wd[..., j:j + 1] * inv) * heads_first(vj)[:, :, None].astype(jnp.float32)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq * d).astype(q.dtype)


def unroll_reference(dparams, dcfg: DrafterConfig, embed, aux, input_ids, lengths, num_steps: int, *,
                     impl: str = "auto") -> list[jax.Array]:
    """:func:`unroll` through ``Drafter.step`` with a growing cache and :func:`step_masks`
    (dense masks over ``(i+1)*T`` slots at step i: slower, kept as the reference).
    Differentiable with ``impl="xla"`` (the native CPU kernels have no gradient)."""
    b, t = input_ids.shape
    _check_length(num_steps, t)
    valid = jnp.arange(t, dtype=jnp.int32)[None] < lengths[:, None]
    model = drafter.Drafter(dcfg, dparams)
    hidden = model.project_features(aux, impl=impl)
    dtype = hidden.dtype
    kv_shape = (1, b, dcfg.num_kv_heads, t, dcfg.head_dim)
    ks, vs, out = [], [], []
    for i in range(num_steps):
        tokens = _step_tokens(dcfg, input_ids, i)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + i, (b, t))
        free = jnp.zeros(kv_shape, dtype)
        cache = KVCache(k=jnp.concatenate(ks + [free], axis=3), v=jnp.concatenate(vs + [free], axis=3),
                        lengths=jnp.full((b,), i * t, jnp.int32))
        slot_mask, mask = step_masks(valid, i)
        if i == 0:  # an all-False constant: keep XLA from constant-folding the masked scores
            slot_mask = jax.lax.optimization_barrier(slot_mask)
        logits, feedback, cache = model.step(tokens, hidden, positions, cache, embed=embed, mask=mask,
                                             slot_mask=slot_mask, impl=impl)
        hidden = _next_hidden(model, feedback, impl)
        ks.append(cache.k[:, :, :, i * t:])
        vs.append(cache.v[:, :, :, i * t:])
        out.append(logits)
    return out


LABELS = ("soft", "hard")


def ttt_loss(draft_logits: list[jax.Array], target_logits, in_vocab, loss_mask, *,
             step_decay: float = 0.8, labels: str = "soft", impl: str = "auto"):
    """Weighted cross-entropy over the TTT steps, against soft or hard labels.

    draft_logits: L arrays [B, T, Vd]; target_logits [B, T, Vd] (target at
    position p, predicting x_{p+1}); in_vocab [B, T] bool; loss_mask [B, T]
    (1 = response token, indexed by label position); labels: "soft" (the
    target's distribution over the draft vocab) or "hard" (its argmax, which
    on weighted positions is the full-vocab argmax). Returns (loss, metrics)
    with metrics ``loss_i``, ``acc_i``, ``count_i`` of shape [L]. The argmaxes
    (the accuracy's, and the hard labels) run through `ops.argmax` (`impl`:
    natively on CPU).
    """
    if labels not in LABELS:
        raise ValueError(f"labels must be one of {LABELS}, got {labels!r}")
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
        top = ops.argmax(jax.lax.stop_gradient(tgt), impl=impl)
        if labels == "soft":
            ce = optax.softmax_cross_entropy(d, jax.nn.softmax(tgt, axis=-1))
        else:
            ce = optax.softmax_cross_entropy_with_integer_labels(d, top)
        cnt = jnp.sum(w)
        denom = jnp.maximum(cnt, 1.0)
        loss_i = jnp.sum(ce * w) / denom
        hit = (ops.argmax(jax.lax.stop_gradient(d), impl=impl) == top).astype(jnp.float32)
        accs.append(jnp.sum(hit * w) / denom)
        losses.append(loss_i)
        counts.append(cnt)
        total = total + (step_decay ** i) * loss_i
    return total, {"loss_i": jnp.stack(losses), "acc_i": jnp.stack(accs), "count_i": jnp.stack(counts)}
