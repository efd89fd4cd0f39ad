"""Acceptance of a verified draft tree: greedy, coupled and rejection sampling.

Greedy: from the root, follow the child whose token equals the target's
argmax; the first mismatch contributes the target's own token.

Coupled (sampling.py): the same walk over the target's race tokens, each
node's processed distribution raced against the noise of the position its
logits predict (a node at depth d predicts position base + d + 1); a draft
is accepted exactly when it equals the token plain coupled sampling would
emit there, so the emitted text is plain coupled sampling's at any depth.

Rejection sampling (lossless): at the current node with target distribution p, try its
children in order. A child c proposed from distribution q is accepted with
probability min(1, p(c) / q(c)); on rejection p <- normalize(max(p - q, 0)).
Deterministic proposals (tree top-k, greedy chains) use q = one-hot(c), which
is the sibling rule of EAGLE.md section 7: zero the rejected token in p and
renormalise. When no child is accepted, the next token is drawn from the
(residual) p; after an accepted leaf it is a bonus token drawn from p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax.config import SpecConfig
from eagle_jax.kernels import ops
from eagle_jax.spec_decode.sampling import (SamplingParams, probabilities, race, sample_probs, split_keys,
                                            uniform_rows)
from eagle_jax.spec_decode.tree import DraftTree


def accept(tree: DraftTree, target_logits, spec: SpecConfig, sampling: SamplingParams | None, keys, noise=None, *,
           impl: str = "auto"):
    """target_logits [B, N, V] of every tree node (node i's logits predict its child).

    sampling: the rows' settings, None when every row is greedy; keys [B, 2] the step's
    keys of the rejection rule; noise [B, D+1, V] the coupled sampler's, index j for
    the token j + 1 past the root (used by coupled rows; greedy rows of a sampled batch
    take the greedy walk). Returns (path [B, D+1] node indices starting with the root,
    valid for the first n+1 entries; n [B] accepted draft tokens; next_token [B]).
    """
    if sampling is None:
        return _follow(tree, ops.argmax(target_logits, impl=impl), spec)
    probs = probabilities(target_logits, sampling, impl=impl)  # [B, N, V]; a greedy row's one-hot
    b = probs.shape[0]
    walked = _follow(tree, race(probs, noise[jnp.arange(b)[:, None], tree.depth]), spec)
    rejecting = (sampling.temperature > 0) & ~sampling.coupled
    rejected = jax.lax.cond(jnp.any(rejecting), lambda: _reject(tree, probs, spec, keys), lambda: walked)
    return jax.tree.map(lambda r, w: jnp.where(rejecting.reshape((b,) + (1,) * (r.ndim - 1)), r, w),
                        rejected, walked)


def _follow(tree: DraftTree, choice, spec: SpecConfig):
    """The greedy walk: from the root, the child whose token equals choice [B, N] (each
    node's target token) at its parent, while one does; then the choice at the last node."""
    b = choice.shape[0]
    children = tree.children(spec.top_k)
    rows = jnp.arange(b)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    accepted = jnp.zeros((b,), jnp.int32)
    path = [cur]
    for _ in range(spec.depth):
        want = choice[rows, cur]
        ch = children[rows, cur]  # [B, width]
        match = (ch >= 0) & (tree.tokens[rows[:, None], jnp.maximum(ch, 0)] == want[:, None])
        hit = alive & jnp.any(match, axis=-1)
        cur = jnp.where(hit, ch[rows, jnp.argmax(match, axis=-1)], cur)
        accepted += hit
        alive = hit
        path.append(cur)
    return jnp.stack(path, 1), accepted, choice[rows, cur]


def _reject(tree: DraftTree, probs, spec: SpecConfig, keys):
    """The rejection rule over the target's processed distributions probs [B, N, V]."""
    b, _, vocab = probs.shape
    width, depth = spec.top_k, spec.depth
    children = tree.children(width)
    rows = jnp.arange(b)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    accepted = jnp.zeros((b,), jnp.int32)
    path = [cur]
    p = probs[:, 0]
    draws = split_keys(keys, depth * width + 1)  # [n, B, 2]
    for level in range(depth):
        taken = jnp.zeros((b,), bool)
        chosen = cur
        for j in range(width):
            c = children[rows, cur, j]
            valid = alive & ~taken & (c >= 0)
            cc = jnp.maximum(c, 0)
            tok = tree.tokens[rows, cc]
            if tree.q is not None:
                q = tree.q[rows, cc]
            else:
                q = jax.nn.one_hot(tok, vocab, dtype=jnp.float32)
            p_tok = p[rows, tok]
            q_tok = q[rows, tok]
            u = uniform_rows(draws[level * width + j])
            ok = valid & (u * q_tok < p_tok)
            residual = jnp.maximum(p - q, 0.0)
            mass = jnp.sum(residual, axis=-1, keepdims=True)
            residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)
            p = jnp.where((valid & ~ok)[:, None], residual, p)
            chosen = jnp.where(ok, c, chosen)
            taken = taken | ok
        cur = jnp.where(taken, chosen, cur)
        p = jnp.where(taken[:, None], probs[rows, cur], p)
        accepted += taken
        alive = taken
        path.append(cur)
    return jnp.stack(path, 1), accepted, sample_probs(draws[-1], p)
