"""The engine's static-batch path: every row starts together and runs to its end in one
device loop, with no host round trip a step.

    out = run_batch(generator, prompt_ids, [Sampling(max_new_tokens=64)] * len(prompt_ids))
    out.tokens[r, :out.num_generated[r]]          # row r's generated ids

One batched prefill (`loop.prefill_jit`, the prompts padded to one length) and
one `loop.run_jit` (a `while_loop` of steps until every row is done). It is the
fast path for a batch known up front (`Generator.generate`, the speed
benchmarks, a mesh); requests that come and go take `Engine` (engine.py), which
runs the same steps one at a time between admissions. Both take the one request
type, `Sampling` (engine/request.py).

Shapes are padded to buckets (prompt columns by `padded_prompt_len`, cache slots
to a multiple of 64, output columns to a multiple of 16) so batches of nearby
sizes share one compiled prefill and loop; `Generator.min_shapes` raises them to
fixed sizes (outputs do not depend on them). An all-greedy batch runs the
greedy program (`SamplingParams` None): sampled rows compile one other.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import jax
import numpy as np

from eagle_jax.engine.request import Sampling, sampling_arrays, to_device
from eagle_jax.sharding import shard_cache, to_host
from eagle_jax.spec_decode import loop
from eagle_jax.spec_decode.sampling import row_keys
from eagle_jax.spec_decode.stats import SpecStats

__all__ = ["BatchOutput", "padded_prompt_len", "batch_inputs", "run_batch"]


@dataclass
class BatchOutput:
    """What a static batch leaves on the host."""
    lc: loop.LoopConfig
    tokens: np.ndarray  # [B, W] generated ids (row r's first num_generated[r] are valid)
    num_generated: np.ndarray  # [B]
    stats: SpecStats | None  # per-row acceptance counters; None when it decoded plainly
    ttft_s: float  # the prefill and first token
    wall_s: float  # the whole batch


def padded_prompt_len(n: int, chunk: int) -> int:
    """Padded prompt length: the least of 16, 24, 32, 48, ... (powers of two and 1.5 times
    them) that holds n, up to `chunk`, then multiples of it. Prefill costs in proportion to
    the padded length on CPU: this pads at most a third (powers of two alone: up to half)."""
    if n > chunk:
        return math.ceil(n / chunk) * chunk
    p = 1 << math.ceil(math.log2(max(n, 16)))
    return min(chunk, 3 * p // 4 if 3 * p // 4 >= n and p >= 32 else p)


def batch_inputs(gen, prompt_ids: Sequence[Sequence[int]], rows: Sequence[Sampling]):
    """(lc, args, static) for `loop.prefill_jit(tparams, dparams, vocab, *args, **static)`:
    the padded prompts, lengths, new-token limits (capped by the context), row keys, sampling
    arrays and empty caches (sharded on the generator's mesh). Speculative when
    `gen.speculates(len(rows))`."""
    b = len(prompt_ids)
    if len(rows) != b:
        raise ValueError(f"{len(rows)} sampling settings for {b} prompts")
    lens = [len(x) for x in prompt_ids]
    # No row can outgrow the context: capping here keeps the output buffer small.
    max_new = [min(s.max_new_tokens, gen.context_limit - n) for s, n in zip(rows, lens)]
    lc = gen.loop_config(gen.speculates(b))
    min_p, min_cache, min_out = gen.min_shapes
    p = padded_prompt_len(max(max(lens), min_p), gen.prefill_chunk)
    tokens = np.zeros((b, p), np.int32)
    for r, x in enumerate(prompt_ids):
        tokens[r, :len(x)] = x
    final = min(gen.context_limit, max(n + m for n, m in zip(lens, max_new)))
    cache_len = max(min_cache, 64 * math.ceil((max(p, final) + lc.cache_scratch) / 64))
    out_width = max(min_out, 16 * math.ceil((max(max_new) + lc.tokens_per_step) / 16))
    caches = loop.create_caches(lc, b, cache_len, gen.target_params["embed"].dtype)
    if gen.mesh is not None:
        caches = tuple(shard_cache(c, gen.mesh) for c in caches)
    keys = row_keys(to_device([s.seed for s in rows], np.int32), to_device([s.seed_stream for s in rows], np.int32))
    sampling = None if all(s.config().greedy for s in rows) else sampling_arrays(rows)
    args = (to_device(tokens, np.int32), to_device(lens, np.int32), to_device(max_new, np.int32), keys, sampling,
            *caches)
    return lc, args, dict(lc=lc, out_width=out_width)


def run_batch(gen, prompt_ids: Sequence[Sequence[int]], rows: Sequence[Sampling]) -> BatchOutput:
    """Prefill every row, then run them all to their end in one device loop."""
    lc, args, static = batch_inputs(gen, prompt_ids, rows)
    t0 = time.perf_counter()
    dparams, vocab = gen.drafter_for(lc)
    with gen.mesh_scope():
        state = loop.prefill_jit(gen.target_params, dparams, vocab, *args, **static)
        jax.block_until_ready(state.pending)
        ttft = time.perf_counter() - t0
        state = loop.run_jit(gen.target_params, dparams, vocab, state, lc=lc)
    out, n, stats = to_host((state.out, state.num_generated, state.stats if lc.speculative else None))
    return BatchOutput(lc, out, n, stats, ttft, time.perf_counter() - t0)
