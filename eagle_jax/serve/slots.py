"""A continuous-batching engine: a fixed set of row slots that requests join and leave between steps.

    engine = SlotEngine(generator, slots=4, max_len=1024)   # compiles its programs before it returns
    req = engine.submit(prompt_ids, Sampling(max_tokens=64), stream=True)   # serve/engine.py's interface

All slots live in one batched `DecodeState` (spec/loop.py) of `slots` rows,
each with `max_len` cache slots and one output width, so one compiled step
serves every mix of requests. One host thread runs the loop:

1. admit: each waiting request takes a free slot and is prefilled alone
   (batch 1), `prefill_chunk` prompt tokens a call (`loop.prompt_chunk_jit`,
   one program for every prompt length), oldest first, up to `prefill_budget`
   prompt tokens between two steps while other rows decode (so newcomers
   stall them for that long at most; 0: no limit), back to back while none
   does; after its last chunk
   it samples its first token (`loop.start_row_jit`) and is written into its
   slot (`loop.insert_jit`; the slot is a traced index: one program for every slot);
2. step: one `loop.step_rows_jit` over the slots up to the highest occupied
   one, rounded up to a row bucket (1, 2, 4, ... and `slots`, each compiled
   at start-up), plain or speculative: a request admitted to the lowest free
   slot, so a lone request pays for one row, not for every slot;
3. observe: read each row's new tokens (`_read`, fresh arrays of at most
   `tokens_per_step` tokens a row), push their text through serve/engine.py's
   stop-string logic, and end rows on EOS, limits, a stop string or a
   cancellation (`loop.finish_rows_jit` marks the row done on the device, and its
   free slot greedy with no filter).

A free slot is a done row: it emits nothing, and the next request written
into it overwrites every leaf of the slot. Sampling settings are per-row
arrays of the state (a greedy row has temperature 0), so no setting
recompiles anything. There is no separate all-greedy program (spec/sampling.py's
`None` settings): with 4 greedy rows on 2 busy cores the sampled step cost
the same (plain 41.5 against 46 ms, chain k=3 90.4 against 90.5 ms). Every
program is compiled at construction (`info()["warmup_s"]`).

Whether the engine has a drafter is fixed at construction (by default
`Generator.speculates(1)`: a drafter is loaded and `disable_by_batch_size` is
not 0); by default a step over more running rows than `disable_by_batch_size`
is plain, as vLLM disables speculation by batch size. Otherwise each
step drafts at a depth `_DraftPolicy` picks (`loop.step(..., depth=d)`: the
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

Not yet here (issue 18, item 1): a draft depth per row (the depth is chosen
for the whole step), and `Generator.generate` on this engine.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.config import SamplingConfig
from eagle_jax.serve.engine import _FINISH, Delta, Done, EngineError, Request, Sampling, _spec_counts
from eagle_jax.spec import loop
from eagle_jax.spec.sampling import SamplingParams, row_keys
from eagle_jax.stops import StreamText

__all__ = ["SlotEngine", "fitting_max_len"]

CATCH_UP_WIDTH = 16  # positions a lagging drafter catches up per call (one program per row bucket)

_keys_jit = jax.jit(row_keys)


@partial(jax.jit, static_argnames=("width",))
def _read(state: loop.DecodeState, start: jax.Array, *, width: int):
    """Fresh host-bound copies: (num_generated [B], done [B], out[b, start[b] : start[b] + width] [B, width],
    stats). Copies, so the next step may donate the state."""
    cols = jnp.minimum(start[:, None] + jnp.arange(width)[None], state.out.shape[1] - 1)
    return (jnp.copy(state.num_generated), jnp.copy(state.done), jnp.take_along_axis(state.out, cols, axis=1),
            jax.tree.map(jnp.copy, state.stats))


@dataclasses.dataclass
class _Fill:
    """A prompt being prefilled into its slot: its one-row buffers on the device."""
    slot: int
    prompt_len: int
    sampling: Sampling
    tokens: np.ndarray  # [1, max_len] the prompt, zero-padded
    done: int  # prompt tokens prefilled so far (a multiple of the chunk)
    tcache: object
    dcache: object
    feats: object  # [1, max_len, A*H] float32, or None without a drafter
    hidden: object = None  # the last chunk's [1, C, H]


@dataclasses.dataclass
class _Row:
    """A request in a slot, as the host sees it."""
    req: Request
    slot: int
    prompt_len: int
    text: StreamText
    admitted: float
    ttft_s: float | None = None
    toks: list = dataclasses.field(default_factory=list)
    most_rows: int = 1  # most rows running together during its life
    fill: _Fill | None = None  # set while its prompt is being prefilled


class SlotEngine:
    """Continuous batching over `slots` rows of `max_len` cache slots (serve/engine.py's interface)."""

    def __init__(self, generator, *, slots: int = 4, max_len: int = 1024, draft_name: str = "none",
                 speculative: bool | None = None, adaptive: bool = True, prefill_chunk: int = 64,
                 prefill_budget: int = 256):
        gen = self.gen = generator
        if gen.mesh is not None:
            raise ValueError("the slot engine runs on one device: a Generator on a mesh decodes with "
                             "generate and stream")
        if gen.tokenizer is None:
            raise ValueError("the slot engine streams text: the target needs a tokenizer")
        if slots < 1:
            raise ValueError(f"need slots >= 1, got {slots}")
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
        lc = _row_config(gen, speculative)
        # Room a step may write past a row's last token (as Generator._prepare sizes its caches).
        self.lc = dataclasses.replace(lc, context_limit=min(gen.context_limit, max_len - lc.cache_scratch))
        if self.lc.context_limit < 16:
            raise ValueError(f"max_len {max_len} leaves {self.lc.context_limit} tokens a row: need at least 16")
        self.slots, self.max_len, self.prefill_chunk = slots, max_len, prefill_chunk
        self.prefill_budget = prefill_budget
        self.row_buckets = sorted({min(1 << i, slots) for i in range(slots.bit_length() + 1)})
        self.width = 16 * -(-(self.lc.context_limit + self.lc.tokens_per_step) // 16)  # output columns per row
        self.draft = draft_name if speculative else "none"
        self.tokenizer, self.context_limit = gen.tokenizer, self.lc.context_limit
        self.vocab_size = gen.target_cfg.vocab_size
        self._dparams, self._vocab = gen._drafter_for(self.lc)
        self._dtype = gen.target_params["embed"].dtype
        self._waiting: deque[Request] = deque()
        self._rows: dict[int, _Row] = {}  # slot -> its row (touched by the loop thread only)
        self._filling: dict[int, _Row] = {}  # slot -> a row whose prompt is being prefilled, oldest first
        self._running = 0
        self.steps: dict[int, int] = {}  # steps taken by draft depth, 0 = plain (the loop thread's count)
        self.catch_ups = 0  # catch_up calls (the loop thread's count)
        self._behind = 0  # no row's drafter lags by more positions (prompts, plain steps since it caught up)
        self._policy = None  # _DraftPolicy once warm-up has timed the steps (adaptive with a drafter)
        self._wake = threading.Condition()
        self.closed = False
        t0 = time.perf_counter()
        self._shapes = self._state_shapes()
        self._state = self._empty()
        self.depth = self.lc.spec.depth if self.lc.speculative else 0  # the deepest draft a step makes
        capped = self.draft_rows is not None and self.draft_rows < slots
        depths = (0,) + _depths(self.depth) if adaptive else tuple(sorted({0, self.depth} if capped else {self.depth}))
        self._costs = self._warm_up(depths)
        if adaptive:
            self._policy = _DraftPolicy(self._costs, self.depth)
        self.warmup_s = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._loop, name="eagle-jax-slots", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the interface

    def info(self) -> dict:
        return {"draft": self.draft, "method": self.lc.spec.method if self.lc.speculative else "plain",
                "engine": "slots", "slots": self.slots, "row_buckets": self.row_buckets, "max_len": self.max_len,
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

    def submit(self, prompt_ids: list[int], sampling: Sampling, *, stream: bool) -> Request:
        """Queue a request (`stream` makes no difference here: every request streams its Deltas)."""
        self.check(prompt_ids)
        _config(sampling)  # a bad setting fails here, not on the loop thread
        if sampling.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
        req = Request(list(prompt_ids), sampling)
        with self._wake:  # under the lock close() takes: nothing joins the queue after the last drain
            if self.closed:
                raise EngineError("the server is shutting down")
            self._waiting.append(req)
            self._wake.notify()
        return req

    def close(self) -> None:
        """Stop taking requests; what is queued or running ends with "abort"."""
        with self._wake:
            self.closed = True
            self._wake.notify()
        self._thread.join(timeout=60)

    # ------------------------------------------------------------ device state

    def _state_shapes(self):
        """The batched state's leaves (shapes and dtypes), as a prefill of `slots` rows gives them."""
        def prefill():
            b = self.slots
            ones = jnp.ones((b,), jnp.int32)
            caches = loop.create_caches(self.lc, b, self.max_len, self._dtype)
            sampling = SamplingParams(jnp.zeros((b,)), jnp.zeros((b,), jnp.int32), jnp.ones((b,)))
            return loop.prefill(self.gen.target_params, self._dparams, self._vocab, jnp.zeros((b, 16), jnp.int32),
                                ones, ones, jnp.zeros((b, 2), jnp.uint32), sampling, *caches, lc=self.lc,
                                out_width=self.width)

        return jax.eval_shape(prefill)

    def _empty(self) -> loop.DecodeState:
        """Every slot free: an all-done state of zeros."""
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._shapes)
        self._behind = 0
        feats, feat_tokens = loop.create_feats(self.lc, self.slots, self.max_len)
        return loop.finish_rows(zeros.replace(feats=feats, feat_tokens=feat_tokens), jnp.ones((self.slots,), bool))

    def _fill(self, slot: int, ids: list[int], sampling: Sampling) -> _Fill:
        """Start prefilling a prompt into `slot`: one-row caches and buffers."""
        tokens = np.zeros((1, self.max_len), np.int32)
        tokens[0, :len(ids)] = ids
        tcache, dcache = loop.create_caches(self.lc, 1, self.max_len, self._dtype)
        feats, _ = loop.create_feats(self.lc, 1, self.max_len)
        return _Fill(slot, len(ids), sampling, tokens, 0, tcache, dcache, feats)

    def _prefill_chunk(self, f: _Fill) -> bool:
        """One chunk of the prompt; after the last one, its first token and its slot in the
        state. Whether the prompt is done (its row runs from the next step on)."""
        c = self.prefill_chunk
        f.tcache, f.feats, f.hidden = loop.prompt_chunk_jit(
            self.gen.target_params, _put(f.tokens[:, f.done:f.done + c], np.int32), _put([f.done], np.int32),
            f.tcache, f.feats, lc=self.lc)
        f.done += c
        if f.done < f.prompt_len:
            return False
        s = f.sampling
        max_new = min(s.max_tokens, self.context_limit - f.prompt_len)
        keys = _keys_jit(_put([s.seed], np.int32), _put([s.seed_stream], np.int32))
        one = loop.start_row_jit(self.gen.target_params, f.hidden, _put(f.tokens, np.int32),
                                 _put([f.prompt_len], np.int32), _put([max_new], np.int32), keys, _params(s),
                                 f.tcache, f.dcache, f.feats, lc=self.lc, out_width=self.width)
        self._state = loop.insert_jit(self._state, one, f.slot)
        if self.lc.catch_up_width:  # with no row running, only the newcomers' lag counts
            self._behind = max(self._behind if self._rows else 0, f.prompt_len)
        return True

    def _bucket(self) -> int:
        """The row bucket that holds every occupied slot."""
        top = max(self._rows) + 1
        return next(b for b in self.row_buckets if b >= top)

    def _catch_up(self, rows: int) -> float:
        """One catch-up call over the first `rows` slots; its seconds."""
        t0 = time.perf_counter()
        self._state = loop.catch_up_rows_jit(self.gen.target_params, self._dparams, self._state,
                                             lc=self.lc, rows=rows)
        jax.block_until_ready(self._state.root_hidden)
        self.catch_ups += 1
        return time.perf_counter() - t0

    def _step(self, rows: int, depth: int) -> float:
        """One step over the first `rows` slots, drafting `depth` levels (0: plain), the drafter
        first caught up if prefills or plain steps left it behind; returns the step's seconds."""
        while depth and self._behind > 0:
            self._catch_up(rows)
            self._behind -= self.lc.catch_up_width
        t0 = time.perf_counter()
        self._state = loop.step_rows_jit(self.gen.target_params, self._dparams, self._vocab, self._state,
                                         lc=self.lc, rows=rows, depth=depth)
        jax.block_until_ready(self._state.num_generated)
        if self.lc.catch_up_width:
            self._behind = self._behind + 1 if depth == 0 else 0
        return time.perf_counter() - t0

    def _finish(self, slots: list[int]) -> None:
        if slots:
            mask = np.zeros((self.slots,), bool)
            mask[slots] = True
            self._state = loop.finish_rows_jit(self._state, _put(mask, bool))

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
        with one depth); leaves every slot free."""
        warm = Sampling(max_tokens=2, temperature=1.0, top_p=0.9, top_k=8)
        fill = self._fill(0, [0] * min(self.prefill_chunk, self.context_limit - 1), warm)  # one program: any start
        while not self._prefill_chunk(fill):
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
            every = _params(warm if filtered else Sampling(max_tokens=2))
            self._state = self._state.replace(sampling=jax.tree.map(lambda a: jnp.repeat(a, self.slots), every))
            timed = {k: run for k, run in runs.items() if not (filtered and k[1] == "catch_up")}
            for _ in range(rounds):
                for (rows, kind), run in timed.items():
                    key = (rows, kind) if kind == "catch_up" else (rows, kind, filtered)
                    costs[key] = min(costs.get(key, float("inf")), run())
        self._observe()  # no rows: only the read
        self._finish([0])
        self._state = self._empty()
        self.catch_ups = 0
        return costs

    # ------------------------------------------------------------ the loop thread

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self.closed or self._waiting or self._rows or self._filling):
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
        row runs); then one step over the occupied slots' bucket; every row observed after each."""
        self._admit()
        started, spent = False, 0
        while self._filling and not (self._rows and self.prefill_budget and spent >= self.prefill_budget):
            row = next(iter(self._filling.values()))
            if row.req.cancelled:
                self._drop_filling(row)
                continue
            spent += self.prefill_chunk
            if self._prefill_chunk(row.fill):
                del self._filling[row.slot]
                row.fill = None
                self._rows[row.slot] = row
                started = True
        if started:
            self._observe()
        if self._rows:
            rows, filtered = self._bucket(), self._filtered()  # the rows this step runs over, before any ends
            if self.draft_rows is not None and len(self._rows) > self.draft_rows:
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
        return any(_filters(r.req.sampling, self.vocab_size) for r in self._rows.values())

    def _horizon(self) -> float:
        """Tokens the running rows have left, on average (what a catch-up's cost is spread over)."""
        left = [min(r.req.sampling.max_tokens, self.context_limit - r.prompt_len) - len(r.toks)
                for r in self._rows.values()]
        return max(1.0, sum(left) / len(left))

    def _admit(self) -> None:
        """Give waiting requests free slots to be prefilled into; drop cancelled ones."""
        with self._wake:
            for req in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(req)
                req.push(Done("abort", len(req.prompt_ids), 0, None, time.monotonic() - req.arrived))
            free = [s for s in range(self.slots) if s not in self._rows and s not in self._filling]
            taken = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
            self._running += len(taken)
        for slot, req in zip(free, taken):
            row = _Row(req, slot, len(req.prompt_ids), StreamText(self.tokenizer, req.sampling.stop),
                       time.monotonic())
            row.fill = self._fill(slot, req.prompt_ids, req.sampling)
            self._filling[slot] = row

    def _drop_filling(self, row: _Row) -> None:
        """A request cancelled while its prompt was being prefilled."""
        with self._wake:
            del self._filling[row.slot]
            self._running -= 1
        row.req.push(Done("abort", row.prompt_len, 0, None, time.monotonic() - row.req.arrived))

    def _observe(self) -> list[int]:
        """Read every row's new tokens; push their text; end the rows that are over. Returns the
        new token counts of the rows that emitted any."""
        start = np.zeros((self.slots,), np.int32)
        for slot, row in self._rows.items():
            start[slot] = len(row.toks)
        n, done, new, stats = jax.tree.map(np.asarray, _read(self._state, _put(start, np.int32),
                                                             width=self.lc.tokens_per_step))
        now = time.monotonic()
        ended = {}  # slot -> its Done
        counts = [int(n[slot] - start[slot]) for slot in self._rows]
        counts = [c for c in counts if c > 0]
        for slot, row in self._rows.items():
            row.ttft_s = row.ttft_s if row.ttft_s is not None else now - row.req.arrived
            row.most_rows = max(row.most_rows, len(self._rows))
            row.toks += new[slot, :n[slot] - start[slot]].tolist()
            final = bool(done[slot]) or row.req.cancelled
            piece, used = row.text.advance(row.toks, final)
            if piece:
                row.req.push(Delta(piece, used))
            if row.text.stopped or final:
                ended[slot] = self._done(row, bool(done[slot]), stats, now)
        self._finish(list(ended))  # free slots filter nothing (loop.finish_rows)
        with self._wake:  # the slots are free before their requests hear of it
            reqs = [self._rows.pop(slot).req for slot in ended]
            self._running -= len(ended)
        for req, event in zip(reqs, ended.values()):
            req.push(event)
        return counts

    def _done(self, row: _Row, device_done: bool, stats, now: float) -> Done:
        if row.text.stopped:
            reason = "stop"
        elif row.req.cancelled and not device_done:
            reason = "abort"
        else:
            reason = _FINISH[self.gen._finish_reason(row.prompt_len, row.toks)]
        spec = _spec_counts(stats, row.slot) if self.lc.speculative else None
        extra = {"slot": row.slot, "batch_size": row.most_rows, "queue_s": row.admitted - row.req.arrived,
                 "tokens_per_s": row.text.tokens / max(now - row.admitted, 1e-9)}
        return Done(reason, row.prompt_len, row.text.tokens, row.ttft_s, now - row.req.arrived, spec, extra)

    def _fail(self, e: BaseException) -> None:
        """A device call failed: every request in flight gets the error; the slots start empty."""
        for req in self._drain():
            req.push(e)
        self._state = self._empty()

    def _abort_all(self) -> None:
        now = time.monotonic()
        for req in self._drain():
            req.push(Done("abort", len(req.prompt_ids), 0, None, now - req.arrived))

    def _drain(self) -> list[Request]:
        """Forget every running and waiting request; returns them."""
        with self._wake:
            reqs = [row.req for row in (*self._rows.values(), *self._filling.values())] + list(self._waiting)
            self._rows.clear()
            self._filling.clear()
            self._waiting.clear()
            self._running = 0
        return reqs


def _row_config(gen, speculative: bool) -> loop.LoopConfig:
    """The engine's loop config, before its rows' context limit: prefills (and plain steps)
    leave its drafter behind, and it catches up CATCH_UP_WIDTH positions a call."""
    return dataclasses.replace(gen._loop_config(speculative), catch_up_width=CATCH_UP_WIDTH if speculative else 0)


def fitting_max_len(gen, prompt_tokens: int, new_tokens: int, prefill_chunk: int = 64) -> int:
    """The least `max_len` (a multiple of 64) whose rows take a prompt of `prompt_tokens`, then
    `new_tokens` more, drafting or not: a step's cache scratch past them, and the prompt's
    last prefill chunk in whole."""
    scratch = _row_config(gen, gen.speculative).cache_scratch
    need = max(prompt_tokens + new_tokens + scratch, -(-prompt_tokens // prefill_chunk) * prefill_chunk)
    return 64 * -(-need // 64)


def _depths(deepest: int) -> tuple[int, ...]:
    """The draft depths an adaptive engine compiles: 1, 2, 4, ... below `deepest`, and `deepest`."""
    return tuple(sorted({1 << i for i in range(deepest.bit_length()) if 1 << i < deepest} | {deepest}))


class _DraftPolicy:
    """The draft depth of each step (0: plain), by expected seconds per token.

    A step at depth d over a row bucket takes `load * base[rows, d, filtered]`
    seconds: `base` holds the warm-up's timings, apart for steps where some
    row asks for top-k or top-p (`filtered`: those filters then run, over
    every drafted position), and `load` is one running mean, over every step,
    of its measured seconds over its warm-up seconds. Whatever else runs on
    the machine slows every depth alike, so it moves `load`, not the ranking
    of the depths. (A running mean per depth let a busy spell of plain steps
    make the untried drafting depths look cheap; the engine then switched
    back and forth, paying catch-ups at each switch: 0.92x plain at
    concurrency 4 on two cores. So did keeping the least time each depth had
    taken: the depth run most, on a machine shared with other work, got the
    luckiest minimum. And the warm-up once timed every step with the filters
    on, as its rows asked for them: drafting looked 23-37% dearer against
    plain than it is for greedy rows (4 rows, Xeon), and the engine stayed plain at 4 rows
    where drafting 2 tokens ran 1.1-1.2x faster.)
    A step at depth d emits 1 + accept[0] + ... + accept[d-1] tokens a row,
    where accept[i] is the share of rows that accepted more than i drafts at
    the steps that drafted past position i (a chain cut to d tokens accepts
    min(accepted, d)), with Laplace's prior ((hits + 1) / (trials + 2): one
    row a step at concurrency 1 is a noisy sample) over counts that decay by
    `decay` every step, plain ones included: they follow the rows running now,
    and a long plain spell (after rows that accepted little) drifts back to
    the prior, so drafting is tried again for the rows that came since. A
    drafting step first pays for the catch-up calls that bring the drafter
    level after new prompts or plain steps (`base[rows, "catch_up"]` each);
    drafting goes on once started, so that cost is spread over the tokens the
    rows have left (`horizon`). While a shallower depth wins, a deepest step
    measures every position again after `probe` of them, then after twice as
    many each time (up to 8x), unless it would lose even if every draft were
    accepted and its catch-up were paid by its own tokens (on two AVX2 cores,
    at concurrency 4, probes that paid about 10 catch-up calls each ran
    0.92-0.93x plain).
    """

    def __init__(self, costs: dict[tuple, float], deepest: int, probe: int = 16, keep: float = 0.8,
                 decay: float = 0.95):
        self.base = dict(costs)  # {(rows, depth, filtered): s, (rows, "catch_up"): s}: SlotEngine._warm_up's
        self.load = 1.0
        self.depths = sorted({k[1] for k in costs if k[1] != "catch_up"})
        self.deepest, self.probe, self.keep, self.decay = deepest, probe, keep, decay
        self._hits, self._trials = [0.0] * deepest, [0.0] * deepest
        self._shallow_run, self._wait = 0, probe

    @property
    def accept(self) -> list[float]:
        return [(h + 1) / (t + 2) for h, t in zip(self._hits, self._trials)]

    def tokens(self, depth: int) -> float:
        """Expected tokens a row from a step at `depth`."""
        return 1.0 + sum(self.accept[:depth])

    def seconds(self, rows: int, depth: int | str, filtered: bool = False) -> float:
        """Expected seconds of a step (or a catch-up call) over `rows` rows, at the present load;
        `filtered`: some row asks for top-k or top-p."""
        return self.load * self.base[(rows, depth) if depth == "catch_up" else (rows, depth, filtered)]

    def seconds_per_token(self, rows: int, depth: int, catch_up_calls: int = 0, horizon: float = 1.0,
                          tokens: float | None = None, filtered: bool = False) -> float:
        """A row's expected seconds per token at `depth` (tokens: as if each step emitted that many)."""
        per_step = self.seconds(rows, depth, filtered) / (self.tokens(depth) if tokens is None else tokens)
        return per_step + (catch_up_calls * self.seconds(rows, "catch_up") / horizon
                           if depth and catch_up_calls else 0.0)

    def choose(self, rows: int, catch_up_calls: int = 0, horizon: float = 1.0, filtered: bool = False) -> int:
        """The depth of the next step over `rows` rows, whose drafter is `catch_up_calls` behind
        and which have `horizon` tokens left on average (`filtered`: as in `seconds`)."""
        cost = partial(self.seconds_per_token, rows, catch_up_calls=catch_up_calls, horizon=horizon,
                       filtered=filtered)
        best = min(self.depths, key=cost)
        if best == self.deepest:
            self._shallow_run, self._wait = 0, self.probe
            return best
        self._shallow_run += 1
        # No probe where it would lose even if every draft were accepted, with its catch-up charged to
        # its own tokens (a probe is one step: more rows than drafting pays for stay plain for good).
        full = self.deepest + 1
        if self._shallow_run < self._wait or cost(self.deepest, horizon=full, tokens=full) > cost(best):
            return best
        self._shallow_run, self._wait = 0, min(2 * self._wait, 8 * self.probe)
        return self.deepest

    def observe(self, rows: int, depth: int, seconds: float, counts: list[int], filtered: bool = False) -> None:
        """A step at `depth` took `seconds`; `counts`: new tokens of each row that emitted any."""
        self.load = self.keep * self.load + (1 - self.keep) * seconds / self.base[rows, depth, filtered]
        self._hits = [self.decay * h for h in self._hits]
        self._trials = [self.decay * t for t in self._trials]
        for i in range(depth if counts else 0):
            self._hits[i] += sum(c - 1 > i for c in counts)
            self._trials[i] += len(counts)


def _filters(s: Sampling, vocab_size: int) -> bool:
    """Whether a request's row makes a step run the top-k or top-p filter (`process_logits`)."""
    c = _config(s)
    return 0 < c.top_k < vocab_size or c.top_p < 1.0


def _params(s: Sampling) -> SamplingParams:
    """One row's sampling arrays (always arrays, greedy included: one program for every setting)."""
    c = _config(s)
    return SamplingParams(temperature=_put([c.temperature], np.float32), top_k=_put([c.top_k], np.int32),
                          top_p=_put([c.top_p], np.float32))


def _config(s: Sampling) -> SamplingConfig:
    """The request's settings, validated (a ValueError names the bad one)."""
    return SamplingConfig(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)


def _put(x, dtype) -> jax.Array:
    """Host values onto the device (a transfer: unlike jnp.asarray, it compiles nothing per new shape)."""
    return jax.device_put(np.asarray(x, dtype))
