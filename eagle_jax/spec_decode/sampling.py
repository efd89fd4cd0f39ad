"""Logit processing (temperature, top-k, top-p), token sampling and per-row keys.

The same processing is applied to target and draft logits, so acceptance
compares the two distributions the user asked for.

Sampling settings are per row: a sampled program carries `SamplingParams`,
arrays of one temperature, top-k and top-p per row, so one compiled program
serves any mix of requests (a row with temperature 0 decodes greedily inside
it). Only "every row greedy" is static: such a program carries no
`SamplingParams` (None) and takes argmaxes only.

Top-k and top-p keep every token at or above a per-row threshold in the
32-bit order of float values: top-k keeps the k largest logits (and any tied
with the k-th), top-p the smallest set of most likely tokens whose mass
reaches p, where a token is kept when the mass of the tokens strictly more
likely than it is below p (tied tokens are kept or dropped together). Each
threshold is found by bisection over that order (exact after 32 halvings; no
sort of the vocabulary), each halving a pass over the row: vectorised in the
native CPU kernels, a reduction in XLA (5-9x slower on CPU at the target's
vocabulary: `python -m eagle_jax.benchmarks.filters`). Each search
runs only when some row of the step asks for it.

Randomness is per row and per position: the decode state holds one PRNG
key per row (``[B, 2]`` uint32, `row_keys`), fixed for the row's life, and
every draw for the token at sequence position p comes from
``fold_in(row key, p)`` (`position_keys`). A row's samples therefore depend
on its own seed only, not on which other rows share the batch.

Two samplers, chosen per row (`SamplingParams.coupled`, an array: no
recompile):

* rejection (the speculative-sampling rule of verify.py): the token at p is
  an inverse-CDF draw (`sample_probs`), and a drafting step splits its keys
  between the drafter's draws and the acceptance tests. Lossless, but the
  randomness a step consumes depends on its draft depth, so the text of a
  seeded row depends on which steps drafted and how deep (with the engine:
  on the load).
* coupled (Gumbel-max, as an exponential race): the token at p is
  argmax_x q(x) / E_p(x), q the processed distribution and E_p(x) i.i.d.
  Exp(1) draws from ``fold_in(row key, p)`` (`exponentials`; argmax of
  log q - log E = log q + Gumbel: an exact draw from q). It depends on the
  seed, the position and the target's logits only. Drafting perturbs the
  drafter's distribution with the same noise and verification accepts a
  draft exactly when it equals the target's perturbed argmax (verify.py):
  greedy speculation over perturbed scores, so speculative text equals plain
  sampled text at any depth, tree or chain, alone or batched.

Rows are coupled unless their request says otherwise (`engine.Sampling.coupled`):
on the shipped drafter (benchmarks/coupling.py) the coupled sampler accepts as
much as rejection sampling or more, a tree more at every temperature (its top_k
children are the race's first k), except a chain at temperature 1.0 (tau 1.65
against 1.78), where rejection's min(1, p/q) is the better per-token coupling.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.config import SamplingConfig
from eagle_jax.kernels import ops


@flax.struct.dataclass
class SamplingParams:
    """Per-row sampling settings of a sampled program (rows [B])."""

    temperature: jax.Array  # [B] float32; 0 = greedy row
    top_k: jax.Array  # [B] int32; 0 = off
    top_p: jax.Array  # [B] float32; 1 = off
    coupled: jax.Array  # [B] bool; True: the coupled (Gumbel-max) sampler, else rejection sampling

    @staticmethod
    def rows(configs: Sequence[SamplingConfig], coupled: bool | Sequence[bool] = False) -> "SamplingParams | None":
        """One row per (validated) config, each coupled or not (one bool: every row);
        None when every row is greedy."""
        if all(c.greedy for c in configs):
            return None
        coupled = [coupled] * len(configs) if isinstance(coupled, bool) else list(coupled)
        return SamplingParams(temperature=jnp.asarray(np.array([c.temperature for c in configs], np.float32)),
                              top_k=jnp.asarray(np.array([c.top_k for c in configs], np.int32)),
                              top_p=jnp.asarray(np.array([c.top_p for c in configs], np.float32)),
                              coupled=jnp.asarray(np.array(coupled, bool)))

    @property
    def races(self) -> jax.Array:
        """[B] bool: rows that sample with the coupled sampler (coupled and not greedy)."""
        return self.coupled & (self.temperature > 0)

    def at(self, ndim: int) -> "SamplingParams":
        """The same settings shaped [B, 1, ...] to broadcast against an ndim array."""
        return jax.tree.map(lambda a: a.reshape(a.shape + (1,) * (ndim - 1)), self)


def _top_k(x: jax.Array, k: jax.Array, impl: str) -> jax.Array:
    """Keep, per row, the logits at or above the k-th largest (k [..., 1]; 0 = all)."""
    return jnp.where(ops.ordered(x) >= ops.kth_largest_key(x, _per_row(k, x), impl=impl), x, -jnp.inf)


def _top_p(x: jax.Array, p: jax.Array, impl: str) -> jax.Array:
    """Keep, per row, the tokens whose strictly more likely tokens hold less than p of the mass."""
    probs = jax.nn.softmax(x, axis=-1)
    cut = ops.top_p_cut_key(probs, _per_row(p, x), impl=impl)
    return jnp.where((ops.ordered(probs) >= cut) | (p >= 1.0), x, -jnp.inf)


def _per_row(setting: jax.Array, x: jax.Array) -> jax.Array:
    """A setting shaped [B, 1, ..., 1] -> one value per row of x [B, ..., V], shaped [B, ...]."""
    return jnp.broadcast_to(setting[..., 0], x.shape[:-1])


def process_logits(logits: jax.Array, params: SamplingParams, *, impl: str = "auto") -> jax.Array:
    """logits [B, ..., V] -> filtered, temperature-scaled logits (-inf outside
    the kept set), row b by params' row b (a greedy row keeps its logits)."""
    s = params.at(logits.ndim)
    t = s.temperature
    x = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)
    x = jax.lax.cond(jnp.any((params.top_k > 0) & (params.top_k < x.shape[-1])),
                     lambda x: _top_k(x, s.top_k, impl), lambda x: x, x)
    return jax.lax.cond(jnp.any(params.top_p < 1.0), lambda x: _top_p(x, s.top_p, impl), lambda x: x, x)


def probabilities(logits: jax.Array, params: SamplingParams, *, impl: str = "auto") -> jax.Array:
    """Processed distribution [B, ..., V] (float32, sums to 1); a greedy row's
    is one-hot at its argmax."""
    soft = jax.nn.softmax(process_logits(logits, params, impl=impl), axis=-1)
    hard = jax.nn.one_hot(ops.argmax(logits, impl="xla"), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(params.at(logits.ndim).temperature > 0, soft, hard)


def row_keys(seeds: jax.Array, streams: jax.Array) -> jax.Array:
    """One key per row [B, 2]: row b's is ``fold_in(PRNGKey(seeds[b]), streams[b])``."""
    return jax.vmap(lambda s, r: jax.random.fold_in(jax.random.PRNGKey(s), r))(seeds, streams)


def position_keys(keys: jax.Array, positions: jax.Array) -> jax.Array:
    """Row keys [B, 2] and positions [B, ...] int -> keys [B, ..., 2]: ``fold_in(keys[b], p)``,
    the randomness of the token at sequence position p of row b."""
    fold = lambda k, p: jax.random.fold_in(k, p)
    for _ in range(positions.ndim - 1):
        fold = jax.vmap(fold, (None, 0))
    return jax.vmap(fold)(keys, positions)


def split_keys(keys: jax.Array, n: int) -> jax.Array:
    """Row keys [B, 2] -> n independent sets of row keys [n, B, 2]."""
    return jax.vmap(lambda k: jax.random.split(k, n), out_axes=1)(keys)


def uniform_rows(keys: jax.Array, shape: tuple[int, ...] = ()) -> jax.Array:
    """Uniform draws in [0, 1) of `shape` per row key [B, 2] -> [B, *shape]."""
    return jax.vmap(lambda k: jax.random.uniform(k, shape))(keys)


def exponentials(keys: jax.Array, positions: jax.Array, vocab: int) -> jax.Array:
    """The coupled sampler's noise: row keys [B, 2], positions [B, P] -> [B, P, vocab]
    float32 i.i.d. Exp(1) draws, row b's at position p from ``fold_in(keys[b], p)`` alone.
    Each is -log u, u uniform in [tiny, 1): positive and finite, so q / E is never 0 / 0."""
    u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, (vocab,), minval=jnp.finfo(jnp.float32).tiny)))(
        position_keys(keys, positions))
    return -jnp.log(u)


def race(probs: jax.Array, noise: jax.Array) -> jax.Array:
    """The coupled sampler's token: argmax_x probs(x) / noise(x) over the last axis
    (probs [..., V] >= 0, noise [..., V] Exp(1) draws) -> [...] int32. An exact draw from
    normalize(probs): the first of the exponential clocks noise(x) / probs(x) to ring."""
    return jnp.argmax(probs / noise, axis=-1).astype(jnp.int32)


def sample_probs(keys: jax.Array, probs: jax.Array, block: int = 256) -> jax.Array:
    """A draw from probabilities [B, ..., V] (may be unnormalised, >= 0, some
    mass in every row) with row b's key -> [B, ...] int32.

    Inverse CDF with one uniform per distribution, in two levels: the block of
    `block` tokens whose cumulative mass first exceeds u * total, then the token
    inside it. No noise per vocabulary entry (jax.random.categorical draws a
    Gumbel per token: 6-7 ms per step over 4 x 49152 logits on two cores,
    against 0.5 ms for this). A token of zero mass is never drawn: an index
    that float rounding pushes past the last positive entry falls back to it.
    """
    v = probs.shape[-1]
    p = jnp.pad(probs.astype(jnp.float32), [(0, 0)] * (probs.ndim - 1) + [(0, (-v) % block)])
    blocks = p.reshape(p.shape[:-1] + (-1, block))  # [..., NB, block]
    mass = jnp.sum(blocks, axis=-1)  # [..., NB]
    upto = jnp.cumsum(mass, axis=-1)
    u = uniform_rows(keys, probs.shape[1:-1]) * upto[..., -1]

    def first_above(cum, x, weights):
        """The first index whose cumulative value exceeds x, else the last of positive weight."""
        n = weights.shape[-1]
        last = n - 1 - jnp.argmax(jnp.flip(weights > 0, axis=-1), axis=-1)
        return jnp.minimum(jnp.sum(cum <= x[..., None], axis=-1), last)

    b = first_above(upto, u, mass)
    inner = jnp.take_along_axis(blocks, b[..., None, None], axis=-2)[..., 0, :]
    rest = u - jnp.take_along_axis(upto - mass, b[..., None], axis=-1)[..., 0]
    j = first_above(jnp.cumsum(inner, axis=-1), rest, inner)
    return jnp.minimum(b * block + j, v - 1).astype(jnp.int32)  # an all-zero row stays in range


def sample(keys, positions, logits: jax.Array, params: SamplingParams | None, *, impl: str = "auto") -> jax.Array:
    """The token at positions [B] of each row from its logits [B, V] -> [B] int32: the
    argmax for greedy rows (every row when params is None); for coupled rows the race
    against the noise at that position (`exponentials`); else a draw with key
    ``fold_in(keys[b], positions[b])`` (keys [B, 2] row keys)."""
    top = ops.argmax(logits, impl=impl)
    if params is None:
        return top
    probs = jax.nn.softmax(process_logits(logits, params, impl=impl), axis=-1)
    rejecting = (params.temperature > 0) & ~params.coupled
    drawn = jax.lax.cond(jnp.any(rejecting), lambda: sample_probs(position_keys(keys, positions), probs),
                         lambda: top)
    raced = jax.lax.cond(jnp.any(params.races),
                         lambda: race(probs, exponentials(keys, positions[:, None], logits.shape[-1])[:, 0]),
                         lambda: top)
    return jnp.where(rejecting, drawn, jnp.where(params.races, raced, top))
