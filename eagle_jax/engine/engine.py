"""The decoding engine: continuous batching over a fixed set of rows that requests join and
leave between steps. Its clients: the HTTP server (serve/), `Generator.stream`, `regenerate`
(train/) and the serving benchmarks. A batch known up front takes its static path
(engine/batch.py: the same steps in one device loop).

    engine = Engine(generator, max_rows=4, max_len=1024)   # compiles its programs before it returns
    req = engine.submit(prompt_ids, Sampling(max_new_tokens=64))
    for event in req:                                      # Delta(text, tokens), then one Done
        ...                                                # (`async for event in req.events()` on an event loop)

Words: a *row* is one sequence of the batch (a request runs in one row); a
*cache slot* is one position of a row's KV cache (`max_len` of them a row).

All rows live in one batched `DecodeState` (spec_decode/loop.py) of `max_rows` rows,
each with `max_len` cache slots and one output width, so one compiled step
serves every mix of requests. One host thread runs the loop:

1. admit: each waiting request takes a free row and is prefilled alone
   (batch 1), `prefill_chunk` prompt tokens a call (`loop.prompt_chunk_jit`,
   one program for every prompt length), oldest first, up to `prefill_budget`
   prompt tokens between two steps while other rows decode (so newcomers
   stall them for that long at most; 0: no limit), back to back while none
   does; after its last chunk it samples its first token
   (`loop.start_row_jit`) and is written into its row (`loop.insert_jit`;
   the row is a traced index: one program for every row);
2. step: one `loop.step_rows_jit` over the rows up to the highest occupied
   one, rounded up to a row bucket (1, 2, 4, ... and `max_rows`, each
   compiled at start-up), plain or speculative: a request is admitted to
   the lowest free row, so a lone request pays for one row, not for all;
3. observe: read each row's new tokens (`_read`, fresh arrays of at most
   `tokens_per_step` tokens a row), push their text through the stop-string
   logic (`eagle_jax.stops.StreamText`), and end rows on EOS, limits, a
   stop string or a cancellation (`loop.finish_rows_jit` marks the row done
   on the device, and its free row greedy with no filter).

A free row is a done row: it emits nothing, and the next request written
into it overwrites every leaf of the row. Sampling settings are per-row
arrays of the state (a greedy row has temperature 0), so no setting
recompiles anything. There is no separate all-greedy program (spec_decode/sampling.py's
`None` settings): with 4 greedy rows on 2 busy cores the sampled step cost
the same (plain 41.5 against 46 ms, chain k=3 90.4 against 90.5 ms). Every
program is compiled at construction (`info()["warmup_s"]`).

Whether the engine has a drafter is fixed at construction (by default
`Generator.speculates(1)`: a drafter is loaded and `disable_by_batch_size` is
not 0); by default a step over more running rows than `disable_by_batch_size`
is plain, as vLLM disables speculation by batch size. Otherwise each
step drafts at a depth `DraftPolicy` (engine/policy.py) picks (`loop.step(..., depth=d)`: the
configured depth D, a shallower `SpecConfig.at_depth`, or 0, a plain step):
the depth whose expected tokens a row (from the measured acceptance at each
position) over its measured step time is highest for the row bucket, as
vLLM and SGLang lower speculation under load. Prefills and plain steps do
no drafter work: they keep the target's features (`LoopConfig.catch_up_width`),
and the drafter catches up over them (`loop.catch_up`, 16 positions a call)
before the next drafting step, so under load, where plain steps win for
good, speculation costs nothing. While prompts are being prefilled, a step
whose drafter lags is plain: the rows about to join would leave it behind
again, so it catches up once, over all of them, at the row bucket they
make. `adaptive=False` drafts at depth D at every step (its drafter too
catches up over each prompt before the step that drafts first).

On the generator's mesh the state's rows lie on the data axis and its caches' KV heads on the
model axis (`sharding.row_shardings`), pinned on the output of every program that returns it, so
no step reshards it; requests take rows one from each data shard in turn, and a row bucket (a
multiple of the data axis) is the first rows of every shard (`LoopConfig.row_groups`).

Not yet here: a draft depth per row (the depth is chosen for the whole step).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import NamedSharding, PartitionSpec

from eagle_jax.engine.lockstep import Channel, default_channel
from eagle_jax.engine.policy import DraftPolicy, draft_depths
from eagle_jax.engine.request import (Delta, Done, EngineError, Request, Sampling,
                                      sampling_arrays, spec_counts, to_device)
from eagle_jax.sharding import row_shardings, shard_cache
from eagle_jax.spec_decode import loop
from eagle_jax.spec_decode.sampling import SamplingParams, row_keys
from eagle_jax.stops import StreamText

__all__ = ["Engine", "fitting_max_len"]

CATCH_UP_WIDTH = 16  # positions a lagging drafter catches up per call (one program per row bucket)

_keys_jit = jax.jit(row_keys)


def _read_rows(state: loop.DecodeState, start: jax.Array, *, width: int):
    """Fresh host-bound copies: (num_generated [B], done [B], out[b, start[b] : start[b] + width] [B, width],
    stats). Copies, so the next step may donate the state."""
    cols = jnp.minimum(start[:, None] + jnp.arange(width)[None], state.out.shape[1] - 1)
    return (jnp.copy(state.num_generated), jnp.copy(state.done), jnp.take_along_axis(state.out, cols, axis=1),
            jax.tree.map(jnp.copy, state.stats))


@dataclasses.dataclass
class _Fill:
    """A prompt being prefilled into its row: its one-row buffers on the device."""
    row: int
    prompt_len: int
    sampling: Sampling
    tokens: np.ndarray  # [1, max_len] the prompt, zero-padded
    done: int  # prompt tokens prefilled so far (a multiple of the chunk)
    tcache: object
    dcache: object
    feats: object  # [1, max_len, A*H] float32, or None without a drafter
    hidden: object = None  # the last chunk's [1, C, H]


@dataclasses.dataclass
class _Job:
    """A request in a row, as the host sees it."""
    req: Request
    row: int
    prompt_len: int
    text: StreamText
    admitted: float
    ttft_s: float | None = None
    toks: list = dataclasses.field(default_factory=list)
    most_rows: int = 1  # most rows running together during its life


class Engine:
    """Continuous batching over `max_rows` rows of `max_len` cache slots (engine/request.py's interface)."""

    def __init__(self, generator, *, max_rows: int = 4, max_len: int = 1024, draft_name: str = "none",
                 speculative: bool | None = None, adaptive: bool = True, prefill_chunk: int = 64,
                 prefill_budget: int = 256, channel: Channel | None = None):
        gen = self.gen = generator
        groups = gen.mesh.shape["data"] if gen.mesh is not None else 1
        if max_rows % groups:
            raise ValueError(f"on a mesh with a data axis of {groups}, max_rows must be a multiple of it "
                             f"(each data shard holds as many rows), got {max_rows}")
        if gen.tokenizer is None:
            raise ValueError("the engine streams text: the target needs a tokenizer")
        if max_rows < 1:
            raise ValueError(f"need max_rows >= 1, got {max_rows}")
        if not 16 <= prefill_chunk <= max_len:
            raise ValueError(f"prefill_chunk must be in [16, max_len={max_len}], got {prefill_chunk}")
        if prefill_budget < 0:
            raise ValueError(f"prefill_budget must be >= 0 (0: no limit), got {prefill_budget}")
        # speculative=None: the generator's disable_by_batch_size decides, per step, as in vLLM; left at
        # "auto", an adaptive engine that drafts at all drafts at any row count its policy finds paying
        # (measured on AVX-512: 1.24x plain at 4 rows, plain at 16 where drafting lost 25-37%).
        limit = gen.disable_by_batch_size if speculative is None else None
        speculative = gen.speculates(1) if speculative is None else speculative and gen.speculative
        adaptive = adaptive and speculative
        if adaptive and gen.spec.disable_by_batch_size == "auto":
            limit = None
        self.draft_rows = limit if speculative else None  # steps over more running rows decode plainly
        lc = dataclasses.replace(_row_config(gen, speculative), row_groups=groups)
        # Room a step may write past a row's last token (as Generator._prepare sizes its caches).
        self.lc = dataclasses.replace(lc, context_limit=min(gen.context_limit, max_len - lc.cache_scratch))
        if self.lc.context_limit < 16:
            raise ValueError(f"max_len {max_len} leaves {self.lc.context_limit} tokens a row: need at least 16")
        self.max_rows, self.max_len, self.prefill_chunk = max_rows, max_len, prefill_chunk
        self.prefill_budget = prefill_budget
        self.row_buckets = sorted({min(groups << i, max_rows) for i in range((max_rows // groups).bit_length() + 1)})
        # Rows are taken in this order: on a mesh, one from each data shard in turn, so that a
        # row bucket of n rows is the first n // groups rows of each shard (`loop._on_rows`).
        per_shard = max_rows // groups
        self._order = [(k % groups) * per_shard + k // groups for k in range(max_rows)]
        self._rank = {row: k for k, row in enumerate(self._order)}
        self.width = 16 * -(-(self.lc.context_limit + self.lc.tokens_per_step) // 16)  # output columns per row
        self.draft = draft_name if speculative else "none"
        self.tokenizer, self.context_limit = gen.tokenizer, self.lc.context_limit
        self.vocab_size = gen.target_cfg.vocab_size
        self._dparams, self._vocab = gen.drafter_for(self.lc)
        self._dtype = gen.target_params["embed"].dtype
        self._waiting: deque[Request] = deque()
        self._jobs: dict[int, _Job] = {}  # row -> its job (touched by the loop thread only)
        self._filling: dict[int, _Job] = {}  # row -> a job whose prompt is being prefilled, oldest first
        self._fills: dict[int, _Fill] = {}  # row -> the device buffers of its prompt being prefilled
        self._running = 0
        self.steps: dict[int, int] = {}  # steps taken by draft depth, 0 = plain (the loop thread's count)
        self.catch_ups = 0  # catch_up calls (the loop thread's count)
        self._behind = 0  # no row's drafter lags by more positions (prompts, plain steps since it caught up)
        self._policy = None  # _DraftPolicy once warm-up has timed the steps (adaptive with a drafter)
        self._wake = threading.Condition()
        self.closed = False
        self._channel = None  # each process warms up alone: no call is sent before the loop runs
        t0 = time.perf_counter()
        self._shapes = self._state_shapes()
        self._sharding = None  # the state's shardings on a mesh (`_empty`), pinned on each program's output
        self._state = self._empty()
        self._programs = _programs(self._sharding, gen.mesh)
        self.depth = self.lc.spec.depth if self.lc.speculative else 0  # the deepest draft a step makes
        capped = self.draft_rows is not None and self.draft_rows < max_rows
        fixed = {0, self.depth} if capped else {self.depth}
        depths = (0,) + draft_depths(self.depth) if adaptive else tuple(sorted(fixed))
        with gen.mesh_scope():
            self._costs = self._warm_up(depths)
        if adaptive:
            self._policy = DraftPolicy(self._costs, self.depth)
        self.warmup_s = time.perf_counter() - t0
        self._channel = channel if channel is not None else default_channel(gen.mesh)
        self.leads = self._channel is None or self._channel.leads
        self._thread = threading.Thread(target=self._loop, name="eagle-jax-engine", daemon=True)
        if self.leads:
            self._thread.start()

    # ------------------------------------------------------------ the interface

    def info(self) -> dict:
        return {"draft": self.draft, "method": self.lc.spec.method if self.lc.speculative else "plain",
                "engine": "continuous", "max_rows": self.max_rows, "row_buckets": self.row_buckets,
                "max_len": self.max_len,
                "warmup_s": round(self.warmup_s, 2), "prefill_chunk": self.prefill_chunk,
                "prefill_budget": self.prefill_budget,
                "adaptive": self._policy is not None, "disable_by_batch_size": self.draft_rows,
                "steps": {str(d): n for d, n in sorted(self.steps.items())}, "catch_ups": self.catch_ups,
                # the warm-up's least time of each (row bucket, draft depth or catch_up), with several
                # depths; "+filter": over rows that ask for top-k and top-p
                "step_ms": {f"{k[0]}x{k[1]}" + ("+filter" if k[2:] == (True,) else ""): round(1e3 * t, 2)
                            for k, t in self._costs.items()}}

    def check(self, prompt_ids: list[int]) -> None:
        self.gen.encode_prompts([prompt_ids], chat=False)
        n = len(prompt_ids)
        if n >= self.context_limit:
            raise ValueError(f"the prompt has {n} tokens; this engine's rows hold {self.context_limit}, "
                             f"leaving no room to generate")
        if -(-n // self.prefill_chunk) * self.prefill_chunk > self.max_len:
            raise ValueError(f"the prompt has {n} tokens; prefilled {self.prefill_chunk} a call it needs "
                             f"{-(-n // self.prefill_chunk) * self.prefill_chunk} cache slots, over this engine's "
                             f"max_len of {self.max_len}")

    def load(self) -> tuple[int, int]:
        with self._wake:
            return self._running, len(self._waiting)

    def submit(self, prompt_ids: list[int], sampling: Sampling) -> Request:
        """Queue a request (checked here, not on the loop thread); its events stream as it runs."""
        if not self.leads:
            raise EngineError("this process follows the engine of process 0: submit requests there")
        self.check(prompt_ids)
        req = Request(list(prompt_ids), sampling)
        with self._wake:  # under the lock close() takes: nothing joins the queue after the last drain
            if self.closed:
                raise EngineError("the engine is closed: it takes no more requests")
            self._waiting.append(req)
            self._wake.notify()
        return req

    def close(self) -> None:
        """Stop taking requests; what is queued or running ends with "abort"."""
        with self._wake:
            self.closed = True
            self._wake.notify()
        if self.leads:
            self._thread.join(timeout=60)
            if self._channel is not None:
                self._channel.send(("close",))

    def follow(self) -> None:
        """Run the leader's engine calls, in its order, until it closes (a process other than 0 of
        a multi-process engine: engine/lockstep.py). A call that fails here ends this process's
        part: the error is raised (the leader's next collective program then waits on it)."""
        if self.leads:
            raise EngineError("the leader's engine runs its own loop; follow() is for the other processes")
        with self.gen.mesh_scope():
            while True:
                name, *args = self._channel.receive()
                if name == "close":
                    self.closed = True
                    return
                if name not in _CALLS:
                    raise EngineError(f"unknown engine call {name!r} from the leader")
                if name == "fill":
                    args[2] = Sampling(**{**args[2], "stop": tuple(args[2]["stop"])})
                getattr(self, f"_{name}")(*args)

    def _call(self, name: str, *args):
        """Engine call `name` (one of `_CALLS`) with host arguments `args`; with followers, sent to
        them first, so that every process makes the same calls in the same order."""
        if self._channel is not None:
            sent = [dataclasses.asdict(a) if isinstance(a, Sampling) else a for a in args]
            self._channel.send((name, *sent))
        return getattr(self, f"_{name}")(*args)

    # ------------------------------------------------------------ device state

    def _state_shapes(self):
        """The batched state's leaves (shapes and dtypes), as a prefill of `max_rows` rows gives them."""
        def prefill():
            b = self.max_rows
            ones = jnp.ones((b,), jnp.int32)
            caches = loop.create_caches(self.lc, b, self.max_len, self._dtype)
            sampling = SamplingParams(jnp.zeros((b,)), jnp.zeros((b,), jnp.int32), jnp.ones((b,)),
                                      jnp.zeros((b,), bool))
            return loop.prefill(self.gen.target_params, self._dparams, self._vocab, jnp.zeros((b, 16), jnp.int32),
                                ones, ones, jnp.zeros((b, 2), jnp.uint32), sampling, *caches, lc=self.lc,
                                out_width=self.width)

        return jax.eval_shape(prefill)

    def _empty(self) -> loop.DecodeState:
        """Every row free: an all-done state of zeros."""
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._shapes)
        self._behind = 0
        feats, feat_tokens = loop.create_feats(self.lc, self.max_rows, self.max_len)
        state = loop.finish_rows(zeros.replace(feats=feats, feat_tokens=feat_tokens), jnp.ones((self.max_rows,), bool))
        if self.gen.mesh is None:
            return state
        if self._sharding is None:
            self._sharding = row_shardings(state, self.gen.mesh)
        return self._placed(state)

    def _placed(self, state: loop.DecodeState) -> loop.DecodeState:
        """The state laid out as the engine's programs take it (on a mesh: by `row_shardings`)."""
        return state if self._sharding is None else jax.device_put(state, self._sharding)

    def _reset(self) -> None:
        """Every row free, every prefill forgotten (after a failed call)."""
        self._fills.clear()
        self._state = self._empty()

    def _fill(self, row: int, ids: list[int], sampling: Sampling) -> None:
        """Start prefilling a prompt into `row`: its one-row caches and buffers (`_fills[row]`)."""
        tokens = np.zeros((1, self.max_len), np.int32)
        tokens[0, :len(ids)] = ids
        tcache, dcache = loop.create_caches(self.lc, 1, self.max_len, self._dtype)
        if self.gen.mesh is not None:  # KV heads on the model axis, as the target's projections make them
            tcache, dcache = shard_cache(tcache, self.gen.mesh), shard_cache(dcache, self.gen.mesh)
        feats, _ = loop.create_feats(self.lc, 1, self.max_len)
        self._fills[row] = _Fill(row, len(ids), sampling, tokens, 0, tcache, dcache, feats)

    def _drop(self, row: int) -> None:
        """Forget the prefill of `row` (its request was cancelled)."""
        del self._fills[row]

    def _prefill_chunk(self, row: int) -> bool:
        """One chunk of the prompt of `row`; after the last one, its first token and its row in
        the state. Whether the prompt is done (its row runs from the next step on)."""
        f, c = self._fills[row], self.prefill_chunk
        f.tcache, f.feats, f.hidden = loop.prompt_chunk_jit(
            self.gen.target_params, to_device(f.tokens[:, f.done:f.done + c], np.int32),
            to_device([f.done], np.int32), f.tcache, f.feats, lc=self.lc)
        f.done += c
        if f.done < f.prompt_len:
            return False
        s = f.sampling
        max_new = min(s.max_new_tokens, self.context_limit - f.prompt_len)
        keys = _keys_jit(to_device([s.seed], np.int32), to_device([s.seed_stream], np.int32))
        one = loop.start_row_jit(self.gen.target_params, f.hidden, to_device(f.tokens, np.int32),
                                 to_device([f.prompt_len], np.int32), to_device([max_new], np.int32), keys,
                                 sampling_arrays([s]), f.tcache, f.dcache, f.feats, lc=self.lc, out_width=self.width)
        self._state = self._programs.insert(self._state, one, f.row)
        del self._fills[row]
        if self.lc.catch_up_width:  # with no row running, only the newcomers' lag counts
            self._behind = max(self._behind if self._jobs else 0, f.prompt_len)
        return True

    def _row_bucket(self) -> int:
        """The row bucket that holds every occupied row."""
        top = max(self._rank[row] for row in self._jobs) + 1
        return next(b for b in self.row_buckets if b >= top)

    def _catch_up(self, rows: int) -> float:
        """One catch-up call over the first `rows` rows; its seconds."""
        t0 = time.perf_counter()
        self._state = self._programs.catch_up_rows(self.gen.target_params, self._dparams, self._state,
                                             lc=self.lc, rows=rows)
        jax.block_until_ready(self._state.root_hidden)
        self.catch_ups += 1
        return time.perf_counter() - t0

    def _step(self, rows: int, depth: int) -> float:
        """One step over the first `rows` rows, drafting `depth` levels (0: plain), the drafter
        first caught up if prefills or plain steps left it behind; returns the step's seconds."""
        while depth and self._behind > 0:
            self._call("catch_up", rows)
            self._behind -= self.lc.catch_up_width
        seconds = self._call("step_rows", rows, depth)
        if self.lc.catch_up_width:
            self._behind = self._behind + 1 if depth == 0 else 0
        return seconds

    def _step_rows(self, rows: int, depth: int) -> float:
        """The step program over the first `rows` rows at draft depth `depth`; its seconds."""
        t0 = time.perf_counter()
        self._state = self._programs.step_rows(self.gen.target_params, self._dparams, self._vocab, self._state,
                                               lc=self.lc, rows=rows, depth=depth)
        jax.block_until_ready(self._state.num_generated)
        return time.perf_counter() - t0

    def _finish(self, rows: list[int]) -> None:
        if rows:
            mask = np.zeros((self.max_rows,), bool)
            mask[rows] = True
            self._state = self._programs.finish_rows(self._state, to_device(mask, bool))

    def _read(self, start: list[int]):
        """Host copies of (num_generated [B], done [B], the next `tokens_per_step` output tokens of
        each row from `start[b]` [B, W], stats)."""
        return jax.tree.map(np.asarray, self._programs.read(self._state, to_device(start, np.int32),
                                                            width=self.lc.tokens_per_step))

    def _warm_up(self, depths: tuple[int, ...], rounds: int = 4) -> dict:
        """Compile and run once: a prefill (a chunk, first token and insert), the step of
        each row bucket and draft depth, the catch-up of each row bucket, the read and the
        finish. With several depths, each step and catch-up is then timed: the least of
        `rounds` runs, taken in turn (every program once a round), so that a burst of other
        work on the machine slows one run of each, not all runs of one. Steps are timed
        twice: over rows that ask for no top-k / top-p filter and over rows that ask for
        both (`process_logits` runs a filter only when some row of the step asks for it,
        and it costs a drafting step more than a plain one: more positions to filter).
        Returns {(rows, depth, filtered): seconds} and {(rows, "catch_up"): seconds} (empty
        with one depth); leaves every row free."""
        warm = Sampling(max_new_tokens=2, temperature=1.0, top_p=0.9, top_k=8)
        self._fill(0, [0] * min(self.prefill_chunk, self.context_limit - 1), warm)  # one program: any start
        while not self._prefill_chunk(0):
            pass
        runs = {}
        for rows in self.row_buckets:
            for depth in depths:
                runs[rows, depth] = partial(self._step, rows, depth)
            if self.lc.catch_up_width:
                runs[rows, "catch_up"] = partial(self._catch_up, rows)
        for run in runs.values():  # the first call compiles
            run()
        costs = {}
        for filtered in (False, True) if len(depths) > 1 else ():
            every = sampling_arrays([warm if filtered else Sampling(max_new_tokens=2)])
            self._state = self._placed(
                self._state.replace(sampling=jax.tree.map(lambda a: jnp.repeat(a, self.max_rows), every)))
            timed = {k: run for k, run in runs.items() if not (filtered and k[1] == "catch_up")}
            for _ in range(rounds):
                for (rows, kind), run in timed.items():
                    key = (rows, kind) if kind == "catch_up" else (rows, kind, filtered)
                    costs[key] = min(costs.get(key, float("inf")), run())
        self._read([0] * self.max_rows)
        self._finish([0])
        self._state = self._empty()
        self.catch_ups = 0
        return costs

    # ------------------------------------------------------------ the loop thread

    def _loop(self) -> None:
        with self.gen.mesh_scope():  # the Pallas kernels' shard_map reads it; a context is per thread
            self._run()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self.closed or self._waiting or self._jobs or self._filling):
                    self._wake.wait()
                if self.closed:
                    break
            try:
                self._iterate()
            except BaseException as e:  # noqa: BLE001 - every request in flight reports it
                self._fail(e)
        self._abort_all()

    def _iterate(self) -> None:
        """Admit what fits; prefill up to `prefill_budget` prompt tokens (with no limit while no
        row runs); then one step over the occupied rows' bucket; every row observed after each."""
        self._admit()
        started, spent = False, 0
        while self._filling and not (self._jobs and self.prefill_budget and spent >= self.prefill_budget):
            job = next(iter(self._filling.values()))
            if job.req.cancelled:
                self._drop_filling(job)
                continue
            spent += self.prefill_chunk
            if self._call("prefill_chunk", job.row):
                del self._filling[job.row]
                self._jobs[job.row] = job
                started = True
        if started:
            self._observe()
        if self._jobs:
            rows, filtered = self._row_bucket(), self._filtered()  # the rows this step runs over, before any ends
            if self.draft_rows is not None and len(self._jobs) > self.draft_rows:
                depth = 0
            elif self._policy and self._filling and self._catch_up_calls():
                depth = 0  # rows are joining: catch up once for all of them, at the bucket they make
            elif self._policy:
                depth = self._policy.choose(rows, self._catch_up_calls(), self._horizon(), filtered)
            else:
                depth = self.depth
            seconds = self._step(rows, depth)
            self.steps[depth] = self.steps.get(depth, 0) + 1
            counts = self._observe()
            if self._policy:
                self._policy.observe(rows, depth, seconds, counts, filtered)

    def _catch_up_calls(self) -> int:
        """Catch-up calls the next drafting step would need first."""
        return -(-self._behind // self.lc.catch_up_width) if self.lc.catch_up_width else 0

    def _filtered(self) -> bool:
        """Whether a running row asks for top-k or top-p (steps then run those filters)."""
        return any(r.req.sampling.filters(self.vocab_size) for r in self._jobs.values())

    def _horizon(self) -> float:
        """Tokens the running rows have left, on average (what a catch-up's cost is spread over)."""
        left = [min(r.req.sampling.max_new_tokens, self.context_limit - r.prompt_len) - len(r.toks)
                for r in self._jobs.values()]
        return max(1.0, sum(left) / len(left))

    def _admit(self) -> None:
        """Give waiting requests free rows to be prefilled into; drop cancelled ones."""
        with self._wake:
            for req in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(req)
                req.push(Done("abort", len(req.prompt_ids), 0, None, time.monotonic() - req.arrived))
            free = [row for row in self._order if row not in self._jobs and row not in self._filling]
            taken = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
            self._running += len(taken)
        for row, req in zip(free, taken):
            job = _Job(req, row, len(req.prompt_ids), StreamText(self.tokenizer, req.sampling.stop),
                       time.monotonic())
            self._call("fill", row, list(req.prompt_ids), req.sampling)
            self._filling[row] = job

    def _drop_filling(self, job: _Job) -> None:
        """A request cancelled while its prompt was being prefilled."""
        self._call("drop", job.row)
        with self._wake:
            del self._filling[job.row]
            self._running -= 1
        job.req.push(Done("abort", job.prompt_len, 0, None, time.monotonic() - job.req.arrived))

    def _observe(self) -> list[int]:
        """Read every row's new tokens; push their text; end the rows that are over. Returns the
        new token counts of the rows that emitted any."""
        start = np.zeros((self.max_rows,), np.int32)
        for row, job in self._jobs.items():
            start[row] = len(job.toks)
        n, done, new, stats = self._call("read", start.tolist())
        now = time.monotonic()
        ended = {}  # row -> its Done
        counts = [int(n[row] - start[row]) for row in self._jobs]
        counts = [c for c in counts if c > 0]
        for row, job in self._jobs.items():
            job.ttft_s = job.ttft_s if job.ttft_s is not None else now - job.req.arrived
            job.most_rows = max(job.most_rows, len(self._jobs))
            job.toks += new[row, :n[row] - start[row]].tolist()
            final = bool(done[row]) or job.req.cancelled
            piece, used = job.text.advance(job.toks, final)
            if piece:
                job.req.push(Delta(piece, used))
            if job.text.stopped or final:
                ended[row] = self._done(job, bool(done[row]), stats, now)
        if ended:
            self._call("finish", list(ended))  # free rows filter nothing (loop.finish_rows)
        with self._wake:  # the rows are free before their requests hear of it
            reqs = [self._jobs.pop(row).req for row in ended]
            self._running -= len(ended)
        for req, event in zip(reqs, ended.values()):
            req.push(event)
        return counts

    def _done(self, job: _Job, device_done: bool, stats, now: float) -> Done:
        if job.text.stopped:
            reason = "stop"
        elif job.req.cancelled and not device_done:
            reason = "abort"
        else:
            reason = self.gen.finish_reason(job.prompt_len, job.toks)
        spec = spec_counts(stats, job.row) if self.lc.speculative else None
        extra = {"row": job.row, "batch_size": job.most_rows, "queue_s": job.admitted - job.req.arrived,
                 "tokens_per_s": job.text.tokens / max(now - job.admitted, 1e-9)}
        return Done(reason, job.prompt_len, job.text.tokens, job.ttft_s, now - job.req.arrived, spec, extra)

    def _fail(self, e: BaseException) -> None:
        """A device call failed: every request in flight gets the error; the rows start empty."""
        for req in self._drain():
            req.push(e)
        self._call("reset")

    def _abort_all(self) -> None:
        now = time.monotonic()
        for req in self._drain():
            req.push(Done("abort", len(req.prompt_ids), 0, None, now - req.arrived))

    def _drain(self) -> list[Request]:
        """Forget every running and waiting request; returns them."""
        with self._wake:
            reqs = [job.req for job in (*self._jobs.values(), *self._filling.values())] + list(self._waiting)
            self._jobs.clear()
            self._filling.clear()
            self._waiting.clear()
            self._running = 0
        return reqs


# The engine calls a leader sends its followers (`Engine._call`): each is the method `_<name>`.
_CALLS = ("fill", "drop", "prefill_chunk", "catch_up", "step_rows", "finish", "read", "reset")


class _Programs(NamedTuple):
    """The engine's jitted programs: those that return its batched state, and the read."""
    step_rows: Callable
    catch_up_rows: Callable
    insert: Callable
    finish_rows: Callable
    read: Callable


def _programs(sharding, mesh) -> _Programs:
    """The loop's programs; on a mesh (`sharding`: the state's NamedShardings) compiled with the
    state's shardings pinned on their output, so that each step takes the state as the last
    one left it (no resharding, no compile after warm-up), and the read's output replicated (every
    process reads it whole)."""
    if sharding is None:
        return _Programs(loop.step_rows_jit, loop.catch_up_rows_jit, loop.insert_jit, loop.finish_rows_jit,
                         _read_jit)
    pin = partial(jax.jit, donate_argnames=("state",), out_shardings=sharding)
    return _Programs(pin(loop.step_rows, static_argnames=("lc", "rows", "depth")),
                     pin(loop.catch_up_rows, static_argnames=("lc", "rows")),
                     pin(loop.insert), pin(loop.finish_rows),
                     jax.jit(_read_rows, static_argnames=("width",), out_shardings=NamedSharding(mesh, PartitionSpec())))


_read_jit = jax.jit(_read_rows, static_argnames=("width",))


def _row_config(gen, speculative: bool) -> loop.LoopConfig:
    """The engine's loop config, before its rows' context limit: prefills (and plain steps)
    leave its drafter behind, and it catches up CATCH_UP_WIDTH positions a call."""
    return dataclasses.replace(gen.loop_config(speculative), catch_up_width=CATCH_UP_WIDTH if speculative else 0)


def fitting_max_len(gen, prompt_tokens: int, new_tokens: int, prefill_chunk: int = 64) -> int:
    """The least `max_len` (a multiple of 64) whose rows take a prompt of `prompt_tokens`, then
    `new_tokens` more, drafting or not: a step's cache scratch past them, and the prompt's
    last prefill chunk in whole."""
    scratch = _row_config(gen, gen.speculative).cache_scratch
    need = max(prompt_tokens + new_tokens + scratch, -(-prompt_tokens // prefill_chunk) * prefill_chunk)
    return 64 * -(-need // 64)
