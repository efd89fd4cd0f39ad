"""Acceptance statistics, with the definitions shared by vLLM, SGLang and llama.cpp.

tau (mean acceptance length) = 1 + accepted / steps, counting the token the
target contributes at every verify step; draft acceptance rate = accepted /
drafted, where a step drafts its depth in tokens (k for a chain, the tree's
depth for a tree: the most it can accept; the engine may lower it step
by step); per-position acceptance rate at position i = steps that accepted
at least i+1 drafts / steps.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class SpecStats:
    steps: jax.Array  # [B] verify steps taken while the row was active
    accepted: jax.Array  # [B] accepted draft tokens that were emitted
    drafted: jax.Array  # [B] draft tokens verified (each step's depth)
    per_position: jax.Array  # [B, D] steps that accepted at least i+1 drafts
    histogram: jax.Array  # [B, D+1] steps by number of accepted drafts

    @classmethod
    def zeros(cls, batch: int, depth: int) -> "SpecStats":
        return cls(steps=jnp.zeros((batch,), jnp.int32), accepted=jnp.zeros((batch,), jnp.int32),
                   drafted=jnp.zeros((batch,), jnp.int32),
                   per_position=jnp.zeros((batch, depth), jnp.int32),
                   histogram=jnp.zeros((batch, depth + 1), jnp.int32))

    def record(self, active: jax.Array, accepted: jax.Array, drafted: int) -> "SpecStats":
        """Add one verify step of depth `drafted` for rows `active` [B] that accepted `accepted` [B] drafts."""
        depth = self.per_position.shape[1]
        a = active.astype(jnp.int32)
        return SpecStats(
            steps=self.steps + a,
            accepted=self.accepted + a * accepted,
            drafted=self.drafted + a * drafted,
            per_position=self.per_position + a[:, None] * (jnp.arange(depth)[None] < accepted[:, None]),
            histogram=self.histogram + a[:, None] * jax.nn.one_hot(accepted, depth + 1, dtype=jnp.int32))


def summarize(stats: SpecStats, rows=None) -> dict:
    """Host-side summary over `rows` (default all): tau, rates, histogram."""
    s = jax.tree.map(np.asarray, stats)
    idx = slice(None) if rows is None else np.asarray(rows)
    steps = int(s.steps[idx].sum())
    accepted = int(s.accepted[idx].sum())
    drafted = int(s.drafted[idx].sum())
    per_pos = s.per_position[idx].sum(0)
    denom = max(steps, 1)
    return {
        "num_verify_steps": steps,
        "accepted_tokens": accepted,
        "acceptance_length": 1.0 + accepted / denom if steps else None,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "per_position_acceptance": [float(x) / denom for x in per_pos] if steps else [],
        "accepted_histogram": [int(x) for x in s.histogram[idx].sum(0)],
    }
