"""The public generation API.

    gen = Generator.load("smollm2-135m-instruct", draft="default")
    result = gen.generate(["Write a haiku about JAX."], max_new_tokens=64)
    stream = gen.stream("Tell me a story.")
    for piece in stream:
        print(piece, end="")
    stream.finish_reason  # "eos", "stop", "length" or "context"

`draft=None` (or "none") gives plain decoding through the same interface.
Prompts are strings (chat-templated unless `chat=False`) or token-id lists.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import jax
import numpy as np

from eagle_jax.config import ConfigError, DrafterConfig, SpecConfig, TargetConfig
from eagle_jax.engine.batch import BatchOutput, run_batch
from eagle_jax.engine.engine import Engine, fitting_max_len
from eagle_jax.engine.request import Done, Request, Sampling
from eagle_jax.kernels import ops
from eagle_jax.models import drafter as drafter_model
from eagle_jax.models import target as target_model
from eagle_jax.runtime import default_disable_by_batch_size, default_dtype, enable_compilation_cache
from eagle_jax.sharding import MeshShape, make_mesh, shard_model
from eagle_jax.spec_decode import loop
from eagle_jax.spec_decode.stats import SpecStats, summarize
from eagle_jax.stops import cut_at_stop


class PromptError(ValueError):
    """A prompt is empty, malformed or does not fit the context."""


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated ids per row (prompt excluded)
    texts: list[str]
    finish_reasons: list[str]  # "eos", "stop", "length" (max_new_tokens) or "context"
    prompt_tokens: list[int]
    stats: dict  # aggregate acceptance statistics (spec_decode/stats.py definitions)
    row_stats: list[dict]
    ttft_s: float  # prefill + first token, wall time
    wall_s: float  # whole request, wall time
    num_generated: int = 0
    tokens_per_s: float = 0.0
    timings: dict = field(default_factory=dict)
    spec_stats: SpecStats | None = None  # the raw per-row counters (host arrays); None when plain

    def stats_of(self, rows: Sequence[int]) -> dict:
        """Acceptance statistics over some rows (as `stats` is over all of them)."""
        return summarize(self.spec_stats, rows=list(rows)) if self.spec_stats is not None else {}


class Generator:
    """A target with an optional EAGLE drafter, and the compiled loops to run them."""

    def __init__(self, target_cfg: TargetConfig, target_params, tokenizer=None, *,
                 drafter: tuple[DrafterConfig, dict, object] | None = None,
                 spec: SpecConfig = SpecConfig(), context_limit: int | None = None,
                 prefill_chunk: int = 512, impl: str = "auto", unroll_layers: bool | None = None,
                 mesh: MeshShape | None = None):
        self.mesh = None
        try:  # once: every loop config carries it (the Pallas kernels read the mesh `mesh_scope` sets)
            resolved = ops.resolve_on_devices(impl, mesh.devices if mesh is not None else 1)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        mla_model = "target" if target_cfg.mla is not None else (
            "drafter" if drafter is not None and drafter[0].mla is not None else None)
        if mla_model is not None and resolved == "native":  # MLA's compressed cache (models/mla.py)
            if impl != "auto":
                raise ConfigError(f"an MLA {mla_model} runs on the XLA or Pallas impls, not the native CPU kernels")
            resolved = "xla"
        impl = resolved
        if mesh is not None and mesh.devices > 1:
            self.mesh = make_mesh(mesh)
        # Per-layer weight buffers (an unrolled layer loop) by default on CPU,
        # where scanning over stacked weights copies them every step; packed
        # projections when the native CPU kernels run.
        self.target_params = target_model.prepare_for_decoding(target_params, target_cfg, impl=impl,
                                                               unroll=unroll_layers)
        self.tokenizer = tokenizer
        self.drafter_cfg, self.drafter_params, self.vocab = drafter if drafter else (None, None, None)
        if self.drafter_params is not None:
            self.drafter_params = drafter_model.prepare_for_decoding(self.drafter_params, impl=impl)
        if self.mesh is not None:
            target_cfg, self.target_params = shard_model(target_model.Target, target_cfg, self.target_params,
                                                         self.mesh)
            if self.drafter_params is not None:
                self.drafter_cfg, self.drafter_params = shard_model(drafter_model.Drafter, self.drafter_cfg,
                                                                    self.drafter_params, self.mesh)
        self.target_cfg = target_cfg
        if self.drafter_cfg is not None and self.drafter_cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"drafter vocab_size {self.drafter_cfg.vocab_size} != target vocab_size "
                             f"{target_cfg.vocab_size}: the drafter was trained for another target")
        if self.drafter_cfg is not None and self.drafter_cfg.target_hidden_size != target_cfg.hidden_size:
            raise ValueError(f"drafter target_hidden_size {self.drafter_cfg.target_hidden_size} != target "
                             f"hidden_size {target_cfg.hidden_size}")
        self.spec = spec
        self.context_limit = min(context_limit or target_cfg.max_position_embeddings,
                                 target_cfg.max_position_embeddings)
        self.prefill_chunk = prefill_chunk
        self.impl = impl
        # Lower bounds on the padded shapes (prompt columns, cache slots, output
        # width): raising them lets requests of different sizes share one
        # compiled prefill and loop. Outputs do not depend on them.
        self.min_shapes = (0, 0, 0)
        self._engine: Engine | None = None  # the one-row engine `stream` runs on, made by the first stream

    @classmethod
    def load(cls, target: str = "smollm2-135m-instruct", draft: str | None = "default", *,
             dtype: str | None = None, spec: SpecConfig = SpecConfig(), **kwargs) -> "Generator":
        """Load a target by name or path and a drafter by name, path, "default" or None."""
        from eagle_jax.convert.bundled import load_drafter_by_name
        from eagle_jax.convert.registry import load_target

        enable_compilation_cache()
        dtype = dtype or default_dtype()
        mesh = kwargs.get("mesh")
        mesh = make_mesh(mesh) if mesh is not None and mesh.devices > 1 else None
        t = load_target(target, dtype=dtype, mesh=mesh)
        d = load_drafter_by_name(draft, t.cfg, target, dtype=dtype, mesh=mesh)
        return cls(t.cfg, t.params, t.tokenizer, drafter=d, spec=spec, **kwargs)

    @property
    def speculative(self) -> bool:
        """A drafter is loaded (whether a given batch speculates: `speculates`)."""
        return self.drafter_cfg is not None

    @property
    def disable_by_batch_size(self) -> int | None:
        """`spec.disable_by_batch_size` with "auto" resolved for this backend."""
        limit = self.spec.disable_by_batch_size
        return default_disable_by_batch_size() if limit == "auto" else limit

    def speculates(self, batch: int) -> bool:
        """Whether a batch of this many rows decodes speculatively: a drafter is
        loaded and the batch is within `disable_by_batch_size`."""
        limit = self.disable_by_batch_size
        return self.speculative and (limit is None or batch <= limit)

    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.target_cfg.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return tuple(sorted(ids))

    # ------------------------------------------------------------------ prompts

    def encode_prompts(self, prompts, chat: bool = True) -> list[list[int]]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise PromptError("no prompts given")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if not p:  # the chat template would wrap an empty user turn: reject it
                    raise PromptError(f"prompt {i} is empty")
                if self.tokenizer is None:
                    raise PromptError("this target has no tokenizer: pass token ids")
                ids = self.tokenizer.apply_chat(p) if chat else self.tokenizer.encode(p)
            else:
                ids = [int(x) for x in p]
                bad = [x for x in ids if not 0 <= x < self.target_cfg.vocab_size]
                if bad:
                    raise PromptError(f"prompt {i}: token id {bad[0]} outside the vocabulary "
                                      f"[0, {self.target_cfg.vocab_size})")
            if not ids:
                raise PromptError(f"prompt {i} is empty")
            if len(ids) >= self.context_limit:
                raise PromptError(f"prompt {i} has {len(ids)} tokens; the context holds "
                                  f"{self.context_limit}, leaving no room to generate")
            out.append(ids)
        return out

    def loop_config(self, speculate: bool) -> loop.LoopConfig:
        """The static config of this generator's decoding programs, drafting or not."""
        return loop.LoopConfig(target=self.target_cfg, drafter=self.drafter_cfg if speculate else None,
                               spec=self.spec, eos_ids=self.eos_ids(),
                               context_limit=self.context_limit, prefill_chunk=self.prefill_chunk,
                               impl=self.impl)

    def drafter_for(self, lc: loop.LoopConfig):
        """(drafter params, draft vocab) for a loop, None for both when it decodes plainly."""
        return (self.drafter_params, self.vocab) if lc.speculative else (None, None)

    def requests(self, b: int, *, max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                 stop=()) -> list[Sampling]:
        """One `Sampling` per row from the API's arguments, each given once for every row or
        once per row (stop: a list of strings, or one list per row). Seed: one int s (row r
        draws from stream r of s), or per row an int s (stream 0 of s) or a (seed, stream)
        pair. A row's samples depend on its pair only, so rows can be regrouped into other
        batches unchanged."""
        max_new = [max_new_tokens] * b if _is_int(max_new_tokens) else max_new_tokens
        if (not isinstance(max_new, (list, tuple)) or len(max_new) != b
                or any(not _is_int(m) or m < 1 for m in max_new)):
            raise PromptError(f"max_new_tokens must be a positive int or one per prompt, got {max_new_tokens!r}")
        temps, ks, ps = (_per_row(name, v, b) for name, v in
                         (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)))
        # Sampling checks its settings when made: a ConfigError names the bad one.
        return [Sampling(max_new_tokens=int(m), temperature=t, top_k=k, top_p=p, seed=s, seed_stream=r,
                         stop=tuple(st))
                for m, t, k, p, (s, r), st in zip(max_new, temps, ks, ps, _row_seeds(seed, b), _row_stops(stop, b))]

    # ------------------------------------------------------------------ running

    def generate(self, prompts, *, max_new_tokens=128, temperature: float | Sequence[float] = 0.0,
                 top_k: int | Sequence[int] = 0, top_p: float | Sequence[float] = 1.0,
                 seed: int | Sequence[int] = 0, chat: bool = True,
                 stop: Sequence[str] | Sequence[Sequence[str]] = ()) -> GenerationResult:
        """Generate for a batch of prompts: the engine's static batch (engine/batch.py), one
        compiled prefill and one compiled loop.

        max_new_tokens, temperature, top_k, top_p, seed and stop may be given
        once for all rows or one per prompt (stop: a list of string lists);
        per-prompt seeds make each row sample as it would alone. The sampling
        settings are arrays of the compiled loop: changing them compiles
        nothing, except between "every row greedy" and not.
        """
        ids = self.encode_prompts(prompts, chat)
        rows = self.requests(len(ids), max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, stop=stop)
        return self._result(ids, rows, run_batch(self, ids, rows))

    def stream(self, prompt, *, max_new_tokens=128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, chat: bool = True,
               stop: Sequence[str] = ()) -> "TextStream":
        """Text pieces as accepted tokens arrive, through the engine (engine/engine.py): one row
        whose cache holds this prompt and its answer (an engine is kept for later streams that
        fit it). Its text equals :meth:`generate`'s for the same seed, greedy or sampled (the
        coupled sampler: spec_decode/sampling.py), whatever draft depths the engine picks.

        Returns a :class:`TextStream`: iterate it for the pieces; once it is
        exhausted its ``finish_reason`` is set as in :meth:`generate`.
        """
        if self.tokenizer is None:
            raise PromptError("streaming text needs a tokenizer")
        (ids,) = self.encode_prompts([prompt], chat)
        (row,) = self.requests(1, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed, stop=stop)
        return TextStream(self._stream_engine(len(ids), row.max_new_tokens).submit(ids, row))

    def mesh_scope(self):
        """The context its loops are called in: its mesh, if it has one (`jax.set_mesh`; the
        Pallas kernels read it to run on each device's block)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _stream_engine(self, prompt_len: int, max_new: int) -> Engine:
        """A one-row engine (on a mesh, a row per data shard) whose rows hold the prompt and its
        answer: the one kept from an earlier stream when it does, else a new one (cache slots a
        power of two, so that nearby lengths share it)."""
        need = fitting_max_len(self, prompt_len, min(max_new, self.context_limit - prompt_len))
        if self._engine is None or self._engine.max_len < need:
            if self._engine is not None:
                self._engine.close()
            rows = self.mesh.shape["data"] if self.mesh is not None else 1  # a row on each data shard
            self._engine = Engine(self, max_rows=rows, max_len=max(256, 1 << (need - 1).bit_length()))
            # Its thread stops before the interpreter does (a thread left inside XLA at exit aborts it).
            weakref.finalize(self, self._engine.close)
        return self._engine

    def finish_reason(self, prompt_len: int, toks: list[int]) -> str:
        """Why a row without a stop-string hit ended: "eos", "context" or "length"."""
        if toks and toks[-1] in self.eos_ids():
            return "eos"
        if prompt_len + len(toks) >= self.context_limit:
            return "context"
        return "length"

    def _result(self, ids, rows: list[Sampling], b: BatchOutput) -> GenerationResult:
        """The host result of a static batch: each row's tokens cut at its stop strings."""
        token_ids, texts, reasons = [], [], []
        for r, prompt in enumerate(ids):
            toks = b.tokens[r, :b.num_generated[r]].tolist()
            reason = self.finish_reason(len(prompt), toks)
            text = ""
            if self.tokenizer is not None:
                toks, text, stopped = cut_at_stop(self.tokenizer, toks, rows[r].stop)
                reason = "stop" if stopped else reason
            token_ids.append(toks)
            texts.append(text)
            reasons.append(reason)
        spec = b.lc.speculative
        total = int(sum(len(t) for t in token_ids))
        decode_s = max(b.wall_s - b.ttft_s, 1e-9)
        return GenerationResult(
            token_ids=token_ids, texts=texts, finish_reasons=reasons,
            prompt_tokens=[len(p) for p in ids],
            stats=summarize(b.stats) if spec else {},
            row_stats=[summarize(b.stats, rows=[r]) for r in range(len(ids))] if spec else [],
            ttft_s=b.ttft_s, wall_s=b.wall_s, num_generated=total, tokens_per_s=total / max(b.wall_s, 1e-9),
            timings={"prefill_s": b.ttft_s, "decode_s": decode_s,
                     "decode_tokens_per_s": (total - len(ids)) / decode_s},
            spec_stats=b.stats)


class TextStream:
    """An iterator of text pieces (:meth:`Generator.stream`, an engine request's deltas);
    ``finish_reason`` ("eos", "stop", "length" or "context") is None until it is exhausted,
    and ``done`` is then the engine's `Done` (token counts, timings, acceptance)."""

    def __init__(self, request: Request):
        self._events = iter(request)
        self.finish_reason: str | None = None
        self.done: Done | None = None

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        for event in self._events:
            if isinstance(event, Done):
                self.done, self.finish_reason = event, event.finish_reason
            elif event.text:
                return event.text
        raise StopIteration


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _row_seeds(seed, b: int) -> list[tuple[int, int]]:
    """(seed, stream) per row: one int s gives row r stream r of s; a list gives, per row,
    an int s (stream 0 of s) or a (seed, stream) pair."""
    if _is_int(seed):
        pairs = [(seed, r) for r in range(b)]
    elif isinstance(seed, (list, tuple)):
        pairs = [(x, 0) if _is_int(x) else tuple(x) if isinstance(x, (list, tuple)) else (x,) for x in seed]
    else:
        pairs = None
    if (pairs is None or len(pairs) != b
            or any(len(p) != 2 or not all(_is_int(v) and 0 <= v < 2 ** 31 for v in p) for p in pairs)):
        raise PromptError(f"seed must be an int in [0, 2**31), or one per prompt (an int or a (seed, stream) "
                          f"pair), got {seed!r}")
    return [(int(s), int(r)) for s, r in pairs]


def _per_row(name: str, value, b: int) -> list:
    """A setting given once for every row, or once per row."""
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != b:
            raise PromptError(f"{name} must be one value or one per prompt ({b}), got {len(value)} values")
        return value.tolist() if isinstance(value, np.ndarray) else list(value)
    return [value] * b


def _row_stops(stop, b: int) -> list[list[str]]:
    """Stop strings per row: one list for every row, or one list per row."""
    if isinstance(stop, str):
        stop = [stop]
    stop = list(stop)
    if stop and all(isinstance(x, (list, tuple)) for x in stop):
        if len(stop) != b:
            raise PromptError(f"{len(stop)} stop lists for {b} prompts")
        rows = [list(x) for x in stop]
    else:
        rows = [stop] * b
    if not all(isinstance(x, str) for row in rows for x in row):
        raise PromptError(f"stop must be strings, or one list of strings per prompt, got {stop!r}")
    return rows
