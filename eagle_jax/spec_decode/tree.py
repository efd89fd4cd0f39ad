"""Drafting: a static-shape draft tree built by the drafter (chain = a tree of width 1).

Node 0 of every tree is the root: the last emitted token, not yet in the
target cache. Nodes 1..N-1 are drafted tokens, ordered so that a parent
always precedes its children and siblings come in decreasing draft score.

Tree drafting follows EAGLE-2's dynamic tree with a fixed envelope
(`SpecConfig`): level 1 holds the top_k children of the root; each further
level expands the top_k frontier nodes (by cumulative draft log-prob) by
their top_k children; finally the N-1 best candidates are kept. A chain is
the same construction with top_k = 1; under rejection sampling it draws
each token from the processed draft distribution instead and records that
distribution for the min(1, p/q) acceptance rule.

A coupled row (sampling.py) drafts the same construction over perturbed
scores: at level l (tokens at position base + l) the top_k of its processed
draft distribution raced against the noise of that position (the target's
noise at each draft token's target id), scored by the log of their share of
the race (log-softmax of log q - log E, the greedy score of perturbed
logits), so its first choice is the token coupled sampling would emit if the
drafter were the target.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from eagle_jax.cache import KVCache
from eagle_jax.config import SpecConfig
from eagle_jax.models import drafter
from eagle_jax.spec_decode.sampling import SamplingParams, probabilities, sample_probs, split_keys

# Each level costs this much score, so a child always ranks strictly below its
# parent and any top-(N-1) selection is closed under taking ancestors.
_LEVEL_EPS = 1e-4


@flax.struct.dataclass
class DraftTree:
    tokens: jax.Array  # [B, N] int32 target ids; tokens[:, 0] is the root
    parents: jax.Array  # [B, N] int32 node index of the parent, -1 for the root
    depth: jax.Array  # [B, N] int32, 0 for the root
    q: jax.Array | None  # [B, N, V] proposal distribution of each node (sampled chains: the rejection rule)

    def children(self, width: int) -> jax.Array:
        """[B, N, width] node indices of each node's children in order, -1 padded."""
        b, n = self.parents.shape
        par = self.parents
        same = (par[:, :, None] == par[:, None, :]) & (jnp.arange(n)[None, None, :] < jnp.arange(n)[None, :, None])
        rank = jnp.sum(same, axis=-1)  # position among earlier siblings
        rows = jnp.arange(b)[:, None]
        target_parent = jnp.where(par >= 0, par, n)  # the root is nobody's child
        out = jnp.full((b, n + 1, width), -1, jnp.int32)
        out = out.at[rows, target_parent, jnp.minimum(rank, width - 1)].set(
            jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)), mode="drop")
        return out[:, :n]

    def attention_mask(self, max_depth: int) -> jax.Array:
        """[B, N, N] bool: node i may attend to node j iff j is i or an ancestor of i."""
        b, n = self.parents.shape
        up = jax.nn.one_hot(self.parents, n, dtype=jnp.int32)  # [B, N, N] i -> parent(i)
        reach = jnp.eye(n, dtype=jnp.int32)[None].repeat(b, 0)
        cur = reach
        for _ in range(max_depth):
            cur = jnp.einsum("bij,bjk->bik", cur, up)
            reach = reach | cur
        return reach.astype(bool)


def draft(dmodel: drafter.Drafter, vocab: drafter.DraftVocab, embed, root_tokens,
          root_hidden, dcache: KVCache, spec: SpecConfig,
          sampling: SamplingParams | None, keys, noise=None, *, impl: str = "auto") -> tuple[DraftTree, KVCache]:
    """Build the draft tree for each row; returns (tree, drafter cache).

    root_tokens [B]; root_hidden [B, H] the drafter output whose head
    predicts the token after the root (and gives the feedback for level 2);
    sampling: the rows' settings, None when every row is greedy (then a
    chain takes the top draft token); keys [B, 2] the step's draft keys (used by
    rejection-sampled chains only); noise [B, depth + 1, V] the coupled sampler's for
    the positions past the root (used by coupled rows); dcache holds the drafter's
    committed context (lengths = target's).
    The returned drafter cache has dcache's lengths, with the drafted K/V as
    scratch in uncommitted slots (the roll-forward writes over the first of
    them; none is ever visible once committed masks apply): one chain of
    in-place writes, so XLA copies no cache. Draft positions: level-l nodes
    are processed at drafter position lengths + l - 1 (the target position of
    their parent).
    """
    k, depth, n = spec.top_k, spec.depth, spec.total_tokens
    b = root_tokens.shape[0]
    target_ids = vocab.target_ids
    sampled_chain = spec.method == "chain" and sampling is not None
    level_keys = split_keys(keys, depth)  # [depth, B, 2]
    root_logits, root_feedback = dmodel.head(root_hidden, impl=impl)

    def propose(logits, level):
        """Draft logits [B, F, Vd] at `level` -> (scores [B, F, k], draft ids [B, F, k], q [B, F, V] | None)."""
        logp = jax.nn.log_softmax(logits, axis=-1)
        if sampling is None:
            scores, ids = jax.lax.top_k(logp, k)
            return scores, ids, None
        q_draft = probabilities(logits, sampling, impl=impl) if sampled_chain else None
        q_full = None
        if sampled_chain:
            ids = sample_probs(level_keys[level], q_draft)[..., None]
            q_full = jnp.zeros(logits.shape[:-1] + vocab.t2d.shape, jnp.float32).at[..., target_ids].set(q_draft)
            scores = jnp.take_along_axis(logp, ids, axis=-1)
        else:
            scores, ids = jax.lax.top_k(logp, k)

        def raced():
            q = probabilities(logits, sampling, impl=impl) if q_draft is None else q_draft
            shares = q / noise[:, level, target_ids][:, None, :]
            top, top_ids = jax.lax.top_k(shares, k)
            share = top / jnp.sum(shares, axis=-1, keepdims=True)
            # Floored: a child always ranks strictly below its parent (see _LEVEL_EPS).
            return jnp.log(jnp.maximum(share, jnp.finfo(jnp.float32).tiny)), top_ids

        r_scores, r_ids = jax.lax.cond(jnp.any(sampling.races), raced, lambda: (scores, ids))
        races = sampling.races[:, None, None]
        return jnp.where(races, r_scores, scores), jnp.where(races, r_ids, ids), q_full

    # Level 1: children of the root.
    s1, ids1, q1 = propose(root_logits[:, None, :], 0)
    cand_score = [s1.reshape(b, k) - _LEVEL_EPS]
    cand_token = [target_ids[ids1.reshape(b, k)]]
    cand_parent = [jnp.full((b, k), -1, jnp.int32)]  # candidate id of the parent; -1 = root
    cand_depth = [jnp.ones((b, k), jnp.int32)]
    cand_q = [None if q1 is None else jnp.broadcast_to(q1, (b, k) + q1.shape[2:])]

    front_id = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
    front_tok, front_score = cand_token[0], cand_score[0]
    front_hidden = jnp.broadcast_to(root_feedback[:, None, :], (b, k, root_feedback.shape[-1]))
    tree_slots = (depth - 1) * k
    front_anc = jnp.zeros((b, k, max(tree_slots, 1)), bool)  # ancestors among drafted slots
    base = dcache.lengths
    num_cands = k
    scratch = dcache
    slot_ids = jnp.arange(scratch.max_len, dtype=jnp.int32)
    for level in range(1, depth):
        offset = (level - 1) * k
        anc = front_anc | jax.nn.one_hot(offset + jnp.arange(k), tree_slots, dtype=bool)[None]
        rel = slot_ids[None, :] - base[:, None]  # [B, S] slot relative to the committed length
        in_tree = (rel >= 0) & (rel < tree_slots)
        tree_vis = jnp.take_along_axis(front_anc, jnp.broadcast_to(
            jnp.clip(rel, 0, tree_slots - 1)[:, None, :], (b, k, scratch.max_len)), axis=2)
        slot_mask = (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree_vis)
        positions = jnp.broadcast_to((base + level - 1)[:, None], (b, k))
        logits, feedback, scratch = dmodel.step(
            front_tok, front_hidden, positions,
            scratch.replace(lengths=base + offset), embed=embed, slot_mask=slot_mask,
            mask=jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k)), impl=impl)
        scores, ids, q = propose(logits, level)  # [B, k, k]
        total = front_score[:, :, None] + scores - _LEVEL_EPS
        flat_score = total.reshape(b, k * k)
        cand_score.append(flat_score)
        cand_token.append(target_ids[ids.reshape(b, k * k)])
        cand_parent.append(jnp.repeat(front_id, k, axis=1))
        cand_depth.append(jnp.full((b, k * k), level + 1, jnp.int32))
        cand_q.append(None if q is None else jnp.repeat(q, k, axis=1))
        # New frontier: the k best of the k*k candidates.
        f_score, f_idx = jax.lax.top_k(flat_score, k)
        src = f_idx // k  # which frontier node each new frontier node came from
        front_id = num_cands + f_idx
        front_tok = jnp.take_along_axis(cand_token[-1], f_idx, axis=1)
        front_score = f_score
        front_hidden = jnp.take_along_axis(feedback, src[:, :, None], axis=1)
        front_anc = jnp.take_along_axis(anc, src[:, :, None], axis=1)
        num_cands += k * k

    score = jnp.concatenate(cand_score, axis=1)
    token = jnp.concatenate(cand_token, axis=1)
    parent = jnp.concatenate(cand_parent, axis=1)
    level_of = jnp.concatenate(cand_depth, axis=1)
    _, sel = jax.lax.top_k(score, n - 1)  # [B, N-1], best first: parents precede children
    rows = jnp.arange(b)[:, None]
    node_of = jnp.zeros((b, num_cands), jnp.int32).at[rows, sel].set(
        jnp.broadcast_to(jnp.arange(1, n, dtype=jnp.int32), (b, n - 1)))
    sel_parent = jnp.take_along_axis(parent, sel, axis=1)
    node_parent = jnp.where(sel_parent < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(sel_parent, 0), axis=1))
    q = None
    if sampled_chain:
        q_all = jnp.concatenate(cand_q, axis=1)
        q = jnp.concatenate([jnp.zeros_like(q_all[:, :1]), jnp.take_along_axis(q_all, sel[:, :, None], axis=1)], 1)
    tree = DraftTree(
        tokens=jnp.concatenate([root_tokens[:, None], jnp.take_along_axis(token, sel, axis=1)], 1),
        parents=jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), node_parent], 1),
        depth=jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.take_along_axis(level_of, sel, axis=1)], 1),
        q=q)
    return tree, scratch.replace(lengths=base)
