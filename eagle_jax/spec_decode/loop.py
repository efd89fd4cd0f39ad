"""The decoding loop: prefill, then one jitted `lax.while_loop` of steps.

Plain decoding is the same loop without a drafter: each step feeds the
pending token to the target and samples one more. A speculative step drafts
a tree (a chain is a tree of width 1), verifies every node with one target
forward under the tree mask, accepts a root path, compacts the accepted K/V
into contiguous cache slots and rolls the drafter forward over the accepted
tokens with the target's features (which also yields the next root's draft
distribution).

Conventions: the *pending* token of a row has been emitted but is not yet in
the target cache; it sits at position `tcache.lengths`. The drafter cache has
the same committed length as the target cache: its entry at position t pairs
the target's features at t with token t+1. With `LoopConfig.catch_up_width`
(the engine, eagle_jax/engine/, mixes plain and drafting steps) the prefill and plain
steps only keep the target's features (`DecodeState.feats`) and the drafter
falls behind; `catch_up` brings it level before a drafting step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import flax.struct
import jax
import jax.numpy as jnp

from eagle_jax.cache import KVCache, head_of, put_head_of
from eagle_jax.config import DrafterConfig, SpecConfig, TargetConfig
from eagle_jax.models import drafter, target
from eagle_jax.spec_decode import tree as tree_lib
from eagle_jax.spec_decode.sampling import SamplingParams, exponentials, position_keys, sample, split_keys
from eagle_jax.spec_decode.stats import SpecStats
from eagle_jax.spec_decode.verify import accept


@dataclass(frozen=True)
class LoopConfig:
    """Everything static about one compiled loop (the sampling settings are
    not: they are arrays of the state, `DecodeState.sampling`)."""

    target: TargetConfig
    drafter: DrafterConfig | None
    spec: SpecConfig
    eos_ids: tuple[int, ...]
    context_limit: int  # a row stops when prompt + generated tokens reach it
    prefill_chunk: int = 512
    impl: str = "auto"
    # > 0: the prefill and plain steps store the target's features (`DecodeState.feats`)
    # instead of running the drafter; `catch_up` rolls it over them, this many positions
    # a call. For the engine: its state holds `create_feats` buffers, and `insert`
    # puts each prefilled row's prompt into them.
    catch_up_width: int = 0
    # The engine's rows come in this many equal blocks, one per shard of a mesh's data axis;
    # a step over `rows` of them takes the first rows // row_groups of each block (`_on_rows`).
    row_groups: int = 1

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    @property
    def tokens_per_step(self) -> int:
        """Most tokens one step can emit."""
        return self.spec.depth + 1 if self.speculative else 1

    @property
    def cache_scratch(self) -> int:
        """Cache slots past a row's committed length that one step may write
        (the verified tokens, plus the tree drafter's scratch nodes)."""
        if not self.speculative:
            return 2
        return max(self.spec.total_tokens + (self.spec.depth - 1) * self.spec.top_k, self.catch_up_width) + 2

    def aux_layers(self) -> tuple[int, ...]:
        return self.drafter.aux_layer_ids if self.speculative else ()


@flax.struct.dataclass
class DecodeState:
    tcache: KVCache
    dcache: KVCache | None
    pending: jax.Array  # [B] last emitted token, not yet in the target cache
    root_hidden: jax.Array | None  # [B, H] the drafter's output whose head predicts the token after `pending`
    out: jax.Array  # [B, W] generated tokens
    num_generated: jax.Array  # [B]
    done: jax.Array  # [B] bool
    prompt_len: jax.Array  # [B]
    max_new: jax.Array  # [B]
    keys: jax.Array  # [B, 2] one PRNG key per row, fixed (spec_decode/sampling.py: draws fold in the position)
    sampling: SamplingParams | None  # per-row settings; None: every row greedy
    stats: SpecStats
    # With lc.catch_up_width, what the drafter has not read yet, by position: the target's
    # features feats [N, S, A*H] (float32) and the token after each position feat_tokens
    # [N, S]; rows [0, B) are this state's (N >= B: a step over the engine's first rows
    # gets the whole buffers). `prefill` gives the prompt's ([B, P, ...]; `insert` puts them
    # into the engine's buffers, `create_feats`), plain steps add theirs. None otherwise.
    feats: jax.Array | None = None
    feat_tokens: jax.Array | None = None


def _emit(state: DecodeState, lc: LoopConfig, new_tokens, count):
    """Append up to count [B] of new_tokens [B, M] per row, honouring EOS and limits.

    Returns (state, m [B] tokens actually emitted; 0 for finished rows).
    """
    gen = state.num_generated
    budget = jnp.minimum(state.max_new - gen, lc.context_limit - (state.prompt_len + gen))
    m = jnp.where(state.done, 0, jnp.clip(jnp.minimum(count, budget), 0))
    j = jnp.arange(new_tokens.shape[1])[None]
    eos = jnp.zeros(new_tokens.shape, bool)
    for e in lc.eos_ids:
        eos = eos | (new_tokens == e)
    eos = eos & (j < m[:, None])
    hit_eos = jnp.any(eos, axis=1)
    m = jnp.where(hit_eos, jnp.argmax(eos, axis=1) + 1, m)
    rows = jnp.arange(new_tokens.shape[0])[:, None]
    cols = jnp.where(j < m[:, None], gen[:, None] + j, state.out.shape[1])
    out = state.out.at[rows, cols].set(new_tokens, mode="drop")
    gen = gen + m
    done = (state.done | hit_eos | (gen >= state.max_new)
            | (state.prompt_len + gen >= lc.context_limit))
    return state.replace(out=out, num_generated=gen, done=done), m


def _last(x, idx):
    """x [B, T, ...] at per-row index idx [B] -> [B, ...]."""
    return jnp.take_along_axis(x, idx.reshape(-1, 1, *([1] * (x.ndim - 2))), axis=1)[:, 0]


def _chunked_prefill(tparams, lc: LoopConfig, tokens, cache):
    """Target forward over the padded prompt in chunks of `lc.prefill_chunk`.

    Returns (hidden [B, P, H], cache with all P slots written, aux [B, P, A*H] | None).
    """
    b, p = tokens.shape
    c = min(p, lc.prefill_chunk)
    nc = p // c
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    chunks = (tokens.reshape(b, nc, c).swapaxes(0, 1), positions.reshape(b, nc, c).swapaxes(0, 1))

    def body(cache, xs):
        hidden, cache, aux = _prompt_part(tparams, lc, *xs, cache)
        return cache, (hidden, aux)

    cache, (hidden, aux) = jax.lax.scan(body, cache, chunks)
    unchunk = lambda x: None if x is None else x.swapaxes(0, 1).reshape(b, p, -1)
    return unchunk(hidden), cache, unchunk(aux)


def _prompt_part(tparams, lc: LoopConfig, tokens, positions, cache: KVCache):
    """The target over prompt tokens [B, C] at positions [B, C] (the cache's next C slots),
    committed: (hidden [B, C, H], cache, aux [B, C, A*H] | None)."""
    hidden, cache, aux = target.Target(lc.target, tparams)(tokens, positions, cache, aux_layers=lc.aux_layers(),
                                                            impl=lc.impl)
    return hidden, cache.commit(jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)), aux


def create_caches(lc: LoopConfig, batch: int, cache_len: int, dtype) -> tuple[KVCache, KVCache | None]:
    """Empty target and drafter caches. They are made outside the jitted prefill
    and donated to it: zeros created inside would be constant-folded by XLA."""
    tcache = target.create_cache(lc.target, batch, cache_len, dtype)
    dcache = drafter.create_cache(lc.drafter, batch, cache_len, dtype) if lc.speculative else None
    return tcache, dcache


def create_feats(lc: LoopConfig, batch: int, cache_len: int) -> tuple[jax.Array | None, jax.Array | None]:
    """`DecodeState.feats` and `feat_tokens` for a lazy drafter (`lc.catch_up_width`),
    else Nones. The features in float32, which holds bf16 ones exactly (XLA's CPU
    backend scatters into a bf16 buffer by converting all of it to float32 and back)."""
    if not (lc.speculative and lc.catch_up_width):
        return None, None
    return (jnp.zeros((batch, cache_len, len(lc.aux_layers()) * lc.target.hidden_size), jnp.float32),
            jnp.zeros((batch, cache_len), jnp.int32))


def prefill(tparams, dparams, vocab, tokens, prompt_len, max_new, keys, sampling: SamplingParams | None,
            tcache: KVCache, dcache: KVCache | None, *, lc: LoopConfig, out_width: int) -> DecodeState:
    """Prompt pass for target (and drafter); emits the first token.

    tokens [B, P] right-padded prompts (P a multiple of the prefill chunk or
    below it); prompt_len [B]; max_new [B] int32; sampling: per-row settings
    or None (every row greedy); empty caches from `create_caches`. With
    `lc.catch_up_width` the drafter does not read the prompt here: the state
    holds its features for `catch_up`, and the drafter cache stays empty.
    """
    b, p = tokens.shape
    hidden, tcache, aux = _chunked_prefill(tparams, lc, tokens, tcache)
    state = _start(tparams, lc, _last(hidden, prompt_len - 1), tcache, prompt_len, max_new, keys, sampling,
                   out_width)
    if not lc.speculative:
        return state
    dtokens = _drafter_tokens(tokens, prompt_len, state.pending)
    if lc.catch_up_width:
        return _lazy(tparams, lc, state, dcache, aux.astype(jnp.float32), dtokens)
    # Drafter prefill: features at t paired with token t+1.
    dmodel = drafter.Drafter(lc.drafter, dparams)
    c = min(p, lc.prefill_chunk)
    nc = p // c
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    split = lambda x: x.reshape(b, nc, c, *x.shape[2:]).swapaxes(0, 1)

    def body(dcache, xs):
        tok, pos, feats = xs
        out, dcache = dmodel(tok, dmodel.project_features(feats, impl=lc.impl), pos, dcache,
                             embed=tparams["embed"], impl=lc.impl)
        return dcache.commit(jnp.full((b,), c, jnp.int32)), _last(out, jnp.clip(prompt_len - 1 - pos[:, 0], 0, c - 1))

    dcache, chunk_out = jax.lax.scan(body, dcache, (split(dtokens), split(positions), split(aux)))
    root_hidden = chunk_out[(prompt_len - 1) // c, jnp.arange(b)]
    return state.replace(dcache=dcache.replace(lengths=prompt_len.astype(jnp.int32)), root_hidden=root_hidden)


def _start(tparams, lc: LoopConfig, last_hidden, tcache: KVCache, prompt_len, max_new, keys,
           sampling: SamplingParams | None, out_width: int) -> DecodeState:
    """The state after a prompt: its cache, the first token sampled from the last
    prompt position's hidden state last_hidden [B, H] and emitted; no drafter yet."""
    b = prompt_len.shape[0]
    last_logits = target.Target(lc.target, tparams).logits(last_hidden, impl=lc.impl)
    first = sample(keys, prompt_len, last_logits, sampling, impl=lc.impl)  # the token at position prompt_len
    state = DecodeState(
        tcache=tcache.replace(lengths=prompt_len.astype(jnp.int32)), dcache=None, pending=first,
        root_hidden=None, out=jnp.zeros((b, out_width), jnp.int32), num_generated=jnp.zeros((b,), jnp.int32),
        done=jnp.zeros((b,), bool), prompt_len=prompt_len.astype(jnp.int32),
        max_new=max_new.astype(jnp.int32), keys=keys, sampling=sampling,
        stats=SpecStats.zeros(b, lc.spec.depth if lc.speculative else 0))
    state, _ = _emit(state, lc, first[:, None], jnp.ones((b,), jnp.int32))
    return state


def _drafter_tokens(tokens, prompt_len, first):
    """The token after each prompt position [B, P]: the prompt shifted left, and the first
    generated token first [B] after the last one (what the drafter pairs with each feature)."""
    b, p = tokens.shape
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    return jnp.where(jnp.arange(p)[None] == (prompt_len - 1)[:, None], first[:, None], shifted).astype(jnp.int32)


def _lazy(tparams, lc: LoopConfig, state: DecodeState, dcache, feats, feat_tokens) -> DecodeState:
    """A prefilled state whose drafter has read nothing: `catch_up` reads the prompt's
    features feats [B, P, A*H] (float32) and feat_tokens [B, P] later."""
    b = state.pending.shape[0]
    return state.replace(dcache=dcache, root_hidden=jnp.zeros((b, lc.drafter.hidden_size), tparams["embed"].dtype),
                         feats=feats, feat_tokens=feat_tokens)


def prompt_chunk(tparams, tokens, start, tcache: KVCache, feats, *, lc: LoopConfig):
    """One chunk of a prompt prefilled a chunk at a time (the engine, between steps):
    tokens [B, C] at positions start [B] + j, where start is the cache's committed length.
    With a drafter (`lc.catch_up_width` > 0) their features go to feats [B, S, A*H] (float32)
    at those positions. Returns (tcache committed, feats, hidden [B, C, H])."""
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    hidden, tcache, aux = _prompt_part(tparams, lc, tokens, positions, tcache)
    if feats is not None:
        feats = jax.vmap(lambda f, a, s: jax.lax.dynamic_update_slice_in_dim(f, a, s, 0))(
            feats, aux.astype(feats.dtype), start)
    return tcache, feats, hidden


def start_row(tparams, hidden, tokens, prompt_len, max_new, keys, sampling: SamplingParams | None,
              tcache: KVCache, dcache: KVCache | None, feats, *, lc: LoopConfig, out_width: int) -> DecodeState:
    """The state after `prompt_chunk` has run over a whole prompt: hidden [B, C, H] is its last
    chunk's, which ends at or after position prompt_len - 1 (a multiple of C); tokens [B, S]
    the prompt, padded to the feature buffer's width. A drafter must be lazy (`lc.catch_up_width`)."""
    c = hidden.shape[1]
    last = _last(hidden, (prompt_len - 1) % c)
    state = _start(tparams, lc, last, tcache, prompt_len, max_new, keys, sampling, out_width)
    if not lc.speculative:
        return state
    if not lc.catch_up_width:
        raise ValueError("start_row needs a lazy drafter (LoopConfig.catch_up_width > 0)")
    return _lazy(tparams, lc, state, dcache, feats, _drafter_tokens(tokens, prompt_len, state.pending))


def _plain_step(tparams, dparams, state: DecodeState, lc: LoopConfig) -> DecodeState:
    """One token a row from the target alone. With a drafter (`lc.speculative`),
    the drafter still rolls forward over it with the target's features, so a
    later speculative step finds its cache and root prediction as if it had
    drafted all along (the engine switches between the two per step); or,
    with `lc.catch_up_width`, the features are kept for `catch_up` to do that later."""
    b = state.pending.shape[0]
    base = state.tcache.lengths
    with jax.named_scope("target"):
        tmodel = target.Target(lc.target, tparams)
        hidden, tcache, aux = tmodel(state.pending[:, None], base[:, None], state.tcache,
                                     aux_layers=lc.aux_layers(), impl=lc.impl)
        logits = tmodel.logits(hidden[:, 0], impl=lc.impl)
    with jax.named_scope("accept"):
        nxt = sample(state.keys, base + 1, logits, state.sampling, impl=lc.impl)
        state, m = _emit(state, lc, nxt[:, None], jnp.ones((b,), jnp.int32))
    state = state.replace(tcache=tcache.commit(m), pending=jnp.where(m > 0, nxt, state.pending))
    if not lc.speculative:
        return state
    if lc.catch_up_width:  # the drafter stays behind; `catch_up` reads these
        rows, at = jnp.arange(b), jnp.where(m > 0, base, state.feats.shape[1])  # finished rows write nothing
        return state.replace(feats=state.feats.at[rows, at].set(aux[:, 0].astype(jnp.float32), mode="drop"),
                             feat_tokens=state.feat_tokens.at[rows, at].set(nxt, mode="drop"))
    return _roll_drafter(tparams, dparams, state, lc, nxt[:, None], aux, base, m)


def catch_up(tparams, dparams, state: DecodeState, *, lc: LoopConfig) -> DecodeState:
    """Roll a lazy drafter (`lc.catch_up_width` > 0) over up to that many of the
    positions it has not read, per row (the prompt's and plain steps'): those from
    `dcache.lengths` on, from `feats` and `feat_tokens`. Rows that are level are
    unchanged; call it until every row is (then a step may draft)."""
    b, width = state.pending.shape[0], lc.catch_up_width
    base = state.dcache.lengths
    m = jnp.clip(state.tcache.lengths - base, 0, width)
    rows = jnp.arange(b)[:, None]
    pos = jnp.minimum(base[:, None] + jnp.arange(width)[None], state.feats.shape[1] - 1)  # [B, W]
    # Back to the dtype the target computed them in (its residual stream's, the embedding's): exact.
    feats = state.feats[rows, pos].astype(tparams["embed"].dtype)
    return _roll_drafter(tparams, dparams, state, lc, state.feat_tokens[rows, pos], feats, base, m)


def _roll_drafter(tparams, dparams, state: DecodeState, lc: LoopConfig, new_tokens, feats, base, m) -> DecodeState:
    """The drafter over a step's m [B] emitted tokens new_tokens [B, T] (T >= m),
    paired with the target's features feats [B, T, A*H] at positions base + j:
    its cache gains those entries, and the last one's output becomes the root
    (its head runs when a step drafts from it: a plain step pays for none)."""
    with jax.named_scope("drafter"):
        positions = base[:, None] + jnp.arange(new_tokens.shape[1])[None]
        dmodel = drafter.Drafter(lc.drafter, dparams)
        out, dcache = dmodel(new_tokens, dmodel.project_features(feats, impl=lc.impl), positions, state.dcache,
                             embed=tparams["embed"], impl=lc.impl)
    return state.replace(dcache=dcache.commit(m), root_hidden=jnp.where(
        (m > 0)[:, None], _last(out, jnp.maximum(m - 1, 0)), state.root_hidden))


def _spec_step(tparams, dparams, vocab, state: DecodeState, lc: LoopConfig, spec: SpecConfig) -> DecodeState:
    """One speculative step drafting as `spec` says (lc.spec or a shallower
    `at_depth` of it); its parts carry the named scopes the step-cost
    breakdown reads (draft, target, accept, commit, drafter)."""
    dcfg = lc.drafter
    b = state.pending.shape[0]
    rows = jnp.arange(b)
    base = state.tcache.lengths
    k_draft, k_accept = split_keys(position_keys(state.keys, base + 1), 2)
    noise = _noise(state, base, spec.depth, lc.target.vocab_size)
    with jax.named_scope("draft"):
        draft, dcache = tree_lib.draft(drafter.Drafter(dcfg, dparams), vocab, tparams["embed"], state.pending,
                                       state.root_hidden, state.dcache, spec, state.sampling, k_draft, noise,
                                       impl=lc.impl)
    with jax.named_scope("target"):
        tmodel = target.Target(lc.target, tparams)
        hidden, tcache, aux = tmodel(draft.tokens, base[:, None] + draft.depth, state.tcache,
                                     mask=draft.attention_mask(spec.depth), aux_layers=dcfg.aux_layer_ids,
                                     impl=lc.impl)
        logits = tmodel.logits(hidden, impl=lc.impl)
    with jax.named_scope("accept"):
        path, n_acc, nxt = accept(draft, logits, spec, state.sampling, k_accept, noise, impl=lc.impl)
        # Emitted tokens: the accepted drafts along the path, then the target's own token.
        j = jnp.arange(spec.depth + 1)[None]
        path_tokens = jnp.take_along_axis(draft.tokens, jnp.concatenate([path[:, 1:], path[:, :1]], 1), axis=1)
        new_tokens = jnp.where(j < n_acc[:, None], path_tokens, nxt[:, None])
        state, m = _emit(state, lc, new_tokens, n_acc + 1)
        stats = state.stats.record(m > 0, jnp.minimum(n_acc, m), spec.depth)
    # Commit root + accepted path nodes (m of them) and roll the drafter over them.
    with jax.named_scope("commit"):
        tcache = tcache.compact(path, m, impl=lc.impl)
    state = state.replace(tcache=tcache, dcache=dcache, stats=stats,
                          pending=jnp.where(m > 0, new_tokens[rows, jnp.maximum(m - 1, 0)], state.pending))
    feats = jnp.take_along_axis(aux, path[:, :, None], axis=1)
    return _roll_drafter(tparams, dparams, state, lc, new_tokens, feats, base, m)


def _noise(state: DecodeState, base, depth: int, vocab: int):
    """The coupled sampler's noise [B, depth + 1, V] for positions base + 1 ... base + depth + 1
    (`sampling.exponentials`), drawn only when some row races (else ones); None for a greedy program."""
    s = state.sampling
    if s is None:
        return None
    positions = base[:, None] + 1 + jnp.arange(depth + 1, dtype=jnp.int32)[None]
    return jax.lax.cond(jnp.any(s.races), lambda: exponentials(state.keys, positions, vocab),
                        lambda: jnp.ones(positions.shape + (vocab,), jnp.float32))


def step(tparams, dparams, vocab, state: DecodeState, *, lc: LoopConfig, depth: int | None = None) -> DecodeState:
    """One decoding step for every unfinished row. With a drafter loaded it
    drafts `depth` levels (None: `lc.spec.depth`; fewer: `lc.spec.at_depth`),
    or with depth 0 it is plain (the drafter kept in step, or with
    `lc.catch_up_width` left behind for `catch_up`); without one, plain. A
    drafting step needs the drafter level with the target."""
    depth = lc.spec.depth if depth is None else depth
    if lc.speculative and depth > 0:
        return _spec_step(tparams, dparams, vocab, state, lc, lc.spec.at_depth(depth))
    return _plain_step(tparams, dparams, state, lc)


def step_rows(tparams, dparams, vocab, state: DecodeState, *, lc: LoopConfig, rows: int,
              depth: int | None = None) -> DecodeState:
    """`step` over rows [0, rows) of the state only; the other rows are left
    as they are (the engine, whose occupied rows are the first `rows`
    pays for those alone)."""
    return _on_rows(partial(step, tparams, dparams, vocab, lc=lc, depth=depth), state, rows, lc)


def catch_up_rows(tparams, dparams, state: DecodeState, *, lc: LoopConfig, rows: int) -> DecodeState:
    """`catch_up` over rows [0, rows) of the state only."""
    return _on_rows(partial(catch_up, tparams, dparams, lc=lc), state, rows, lc)


def _on_rows(fn, state: DecodeState, rows: int, lc: LoopConfig) -> DecodeState:
    """fn(state) -> state over rows [0, rows), the other rows left as they are; with
    `lc.row_groups` blocks of rows (a mesh's data shards), over the first rows // row_groups
    of each block (`cache.head_of`). With the native CPU kernels the caches are not copied:
    fn works on views of their first rows (`KVCache.head_rows`); in one block `feats` and
    `feat_tokens` go whole."""
    if rows == state.pending.shape[0]:
        return fn(state)
    g = lc.row_groups
    head = lambda c: None if c is None else c.head_rows(rows, impl=lc.impl, groups=g)
    whole = dict(tcache=None, dcache=None, feats=None, feat_tokens=None)
    if g > 1:  # feats go by row too: a step's row i is the i-th of its own rows
        whole = dict(tcache=None, dcache=None)
    part = jax.tree.map(lambda x: head_of(x, rows, g), state.replace(**whole))
    part = fn(part.replace(tcache=head(state.tcache), dcache=head(state.dcache),
                           **({} if g > 1 else dict(feats=state.feats, feat_tokens=state.feat_tokens))))
    rest = jax.tree.map(lambda big, small: put_head_of(big, small, g), state.replace(**whole), part.replace(**whole))
    rest = rest if g > 1 else rest.replace(feats=part.feats, feat_tokens=part.feat_tokens)
    return rest.replace(tcache=state.tcache.put_head_rows(part.tcache, g),
                        dcache=None if state.dcache is None else state.dcache.put_head_rows(part.dcache, g))


def run(tparams, dparams, vocab, state: DecodeState, *, lc: LoopConfig) -> DecodeState:
    """Steps until every row is done, inside one `lax.while_loop`."""
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                              partial(step, tparams, dparams, vocab, lc=lc), state)


def insert(state: DecodeState, row: DecodeState, slot) -> DecodeState:
    """State `state` (batch B) with row `slot` (a traced int) replaced by the
    one-row state `row` (batch 1, same cache length and output width).

    Every leaf of the slot is overwritten along its batch axis (axis 1 of the
    caches' k/v, axis 0 elsewhere), so nothing of its previous row survives,
    except in `feats` and `feat_tokens`, where the row's prompt [1, P, ...]
    goes to the slot's first P positions: `catch_up` reads a row's positions
    only up to what its prefill and its plain steps wrote."""
    def put(big, one, axis=0):
        return jax.lax.dynamic_update_slice_in_dim(big, one.astype(big.dtype), slot, axis)

    def put_prefix(big, one):  # [N, S, ...] <- [1, P, ...] at (slot, 0, ...), P <= S
        if big is None or one is None:
            return big
        return jax.lax.dynamic_update_slice(big, one.astype(big.dtype), (slot,) + (0,) * (big.ndim - 1))

    def put_cache(big: KVCache | None, one: KVCache | None):
        if big is None:
            return None
        return big.replace(k=put(big.k, one.k, 1), v=put(big.v, one.v, 1), lengths=put(big.lengths, one.lengths))

    whole = dict(tcache=None, dcache=None, feats=None, feat_tokens=None)
    rest = jax.tree.map(put, state.replace(**whole), row.replace(**whole))
    return rest.replace(tcache=put_cache(state.tcache, row.tcache), dcache=put_cache(state.dcache, row.dcache),
                        feats=put_prefix(state.feats, row.feats),
                        feat_tokens=put_prefix(state.feat_tokens, row.feat_tokens))


def finish_rows(state: DecodeState, rows: jax.Array) -> DecodeState:
    """Mark rows [B] bool done: they emit nothing more (a stop string, a cancellation, or
    the row ended and its slot is free). Their sampling turns greedy with no filter, so a
    free slot does not make every step run the top-k / top-p filters (`process_logits`
    runs each only where some row of the step asks for it)."""
    s = state.sampling
    if s is not None:
        s = SamplingParams(temperature=jnp.where(rows, 0.0, s.temperature), top_k=jnp.where(rows, 0, s.top_k),
                           top_p=jnp.where(rows, 1.0, s.top_p), coupled=s.coupled & ~rows)
    return state.replace(done=state.done | rows, sampling=s)


prefill_jit = jax.jit(prefill, static_argnames=("lc", "out_width"), donate_argnames=("tcache", "dcache"))
prompt_chunk_jit = jax.jit(prompt_chunk, static_argnames=("lc",), donate_argnames=("tcache", "feats"))
start_row_jit = jax.jit(start_row, static_argnames=("lc", "out_width"), donate_argnames=("tcache", "dcache", "feats"))
run_jit = jax.jit(run, static_argnames=("lc",), donate_argnames=("state",))
step_jit = jax.jit(step, static_argnames=("lc", "depth"), donate_argnames=("state",))
step_rows_jit = jax.jit(step_rows, static_argnames=("lc", "rows", "depth"), donate_argnames=("state",))
catch_up_rows_jit = jax.jit(catch_up_rows, static_argnames=("lc", "rows"), donate_argnames=("state",))
insert_jit = jax.jit(insert, donate_argnames=("state",))
finish_rows_jit = jax.jit(finish_rows, donate_argnames=("state",))
