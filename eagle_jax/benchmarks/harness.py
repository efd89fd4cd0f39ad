"""Decoding-speed harness: interleaved runs of several engines on the same prompts.

Vocabulary:

* an *engine* decodes a batch of prompts given as token ids: eagle-jax plain,
  eagle-jax with a drafter (chain or tree), or a peer (``benchmarks/peers.py``);
* a *workload* is a prompt set, a batch size, a temperature and a token
  budget; its batches are consecutive groups of ``batch_size`` prompts;
* the first engine of a workload is its *baseline* (eagle-jax plain decoding
  of the same engine: same target weights, same compiled runtime).

Protocol per workload:

1. Warm-up, once per engine and compiled shape: the first batch with a
   2-token budget, twice; ``compile_s`` is the difference of the two wall
   times (tracing + XLA compile, or a persistent-cache load when the cache is
   warm). Shapes are fixed per group of workloads (prompt padding, KV-cache
   length, output width) so that one compile serves every batch.
2. ``rounds`` timed rounds. In each round every batch is run by every engine
   in turn (A, B, C, A, B, C, ...); odd rounds reverse the engine order, so
   slow drift of the machine (other jobs on shared cores) falls on all
   engines alike. Every speedup is computed from these interleaved runs only.

Metrics per engine (see `summarize_engine`): total tokens/s (all tokens of
all timed runs / their summed wall time), per-request tokens/s (a row's
tokens / its batch's wall time, averaged), speedup against the baseline
(ratio of total tokens/s, and the median of the per-run paired ratios), TTFT
(median; prefill + first token), decode tokens/s (the tokens after each
row's first over the time after the first token), acceptance statistics (tau, per-position
acceptance, draft acceptance rate, histogram; EAGLE.md section 7
definitions, summed over runs), the share of greedy outputs identical to the
baseline's, and memory: the process RSS high-water mark after the engine's
runs (`resource.getrusage`; process-wide and monotonic, so it is an upper
bound for the engines run so far) and, on GPU/TPU, the device's
`memory_stats()` peak.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import resource
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from eagle_jax.benchmarks.datasets import Prompt
from eagle_jax.runtime import machine_info

# Results go under the working directory (in a checkout: the committed benchmarks/results/ data
# folder), never inside the installed package; every command takes --output-dir.
RESULTS_DIR = os.path.join("benchmarks", "results")
WARMUP_TOKENS = 2


def machine_slug(info: dict) -> str:
    if info.get("backend") not in (None, "cpu"):
        name = info["devices"][0]
        slug = f"{info['backend']}-{name}"
    else:
        cores = info.get("cpu_affinity") or info.get("cpu_count")
        slug = f"cpu-{info['cpu_model']}-{cores}c"
    return "".join(c if c.isalnum() else "-" for c in slug.lower()).strip("-").replace("--", "-")


def library_versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("eagle-jax", "jax", "jaxlib", "transformers", "torch", "llama_cpp_python", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def command_line(argv: Sequence[str] | None = None) -> str:
    """The exact command, with the console script shown by name."""
    argv = list(sys.argv if argv is None else argv)
    head = os.path.basename(argv[0]) if argv else ""
    if head == "eagle-jax":
        return shlex.join(["eagle-jax", *argv[1:]])
    if head.endswith(".py"):
        return shlex.join(["python", os.path.relpath(argv[0]) if os.path.isabs(argv[0]) else argv[0], *argv[1:]])
    return shlex.join(argv)


def peak_memory() -> dict:
    """RSS high-water mark of this process (MiB) and the device's memory peak when reported."""
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    try:
        import jax

        if jax.default_backend() != "cpu":
            stats = jax.local_devices()[0].memory_stats() or {}
            if "peak_bytes_in_use" in stats:
                out["device_peak_mb"] = stats["peak_bytes_in_use"] / 2**20
            if "bytes_in_use" in stats:
                out["device_in_use_mb"] = stats["bytes_in_use"] / 2**20
            if "bytes_limit" in stats:
                out["device_limit_mb"] = stats["bytes_limit"] / 2**20
    except Exception:  # memory stats are best effort
        pass
    return out


def timestamp() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


# ----------------------------------------------------------------------------- engines


@dataclass
class RunRecord:
    token_ids: list[list[int]]
    wall_s: float
    ttft_s: float | None
    stats: dict = field(default_factory=dict)  # acceptance counts (speculative engines)


class Engine(Protocol):
    name: str
    kind: str  # "eagle-jax" | "transformers" | "llama.cpp"
    max_batch: int | None  # None = any batch size

    def describe(self) -> dict: ...

    def run(self, ids: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> RunRecord: ...


class EagleEngine:
    """eagle-jax through the public `Generator.generate` (plain or speculative)."""

    kind = "eagle-jax"
    max_batch = None

    def __init__(self, name: str, generator, *, method: str, drafter: dict | None = None):
        self.name = name
        self.gen = generator
        self.method = method  # plain | chain | tree
        self.drafter = drafter  # {"label", "variant", "random_init", "path"}

    def describe(self) -> dict:
        d = {"engine": self.kind, "method": self.method,
             "drafter": self.drafter, "dtype": str(self.gen.target_params["embed"].dtype)}
        if self.method != "plain":
            s = self.gen.spec
            d["spec"] = dataclasses.asdict(s)
            d["setting"] = (f"k={s.num_speculative_tokens}" if s.method == "chain"
                            else f"top_k={s.tree_top_k} depth={s.tree_depth} total={s.tree_total_tokens}")
            d["disable_by_batch_size"] = self.gen.disable_by_batch_size  # larger batches ran plainly
        return d

    # -- compiled shapes
    def scratch(self) -> int:
        s = self.gen.spec
        return s.total_tokens + (s.depth - 1) * s.top_k + 2 if self.gen.speculative else 2

    def tokens_per_step(self) -> int:
        return self.gen.spec.depth + 1 if self.gen.speculative else 1

    def set_shape(self, prompt_pad: int, cache_len: int, max_new_tokens: int) -> tuple:
        out_width = 16 * math.ceil((max_new_tokens + self.tokens_per_step()) / 16)
        self.gen.min_shapes = (prompt_pad, cache_len, out_width)  # raised only: outputs unchanged
        return self.gen.min_shapes

    def run(self, ids, max_new_tokens, temperature, seed) -> RunRecord:
        r = self.gen.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        stats = {}
        if self.gen.speculative and r.stats:
            stats = {k: r.stats[k] for k in ("num_verify_steps", "accepted_tokens",
                                             "per_position_acceptance", "accepted_histogram")}
        return RunRecord(token_ids=r.token_ids, wall_s=r.wall_s, ttft_s=r.ttft_s, stats=stats)


def prompt_bucket(n: int, chunk: int = 512) -> int:
    from eagle_jax.engine.batch import padded_prompt_len

    return padded_prompt_len(n, chunk)


# ----------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    dataset: str
    batch_size: int
    temperature: float
    max_new_tokens: int
    prompts: list[Prompt]
    engines: list[str]  # engine names; the first is the baseline
    group: str = ""  # workloads of one group (and batch size) share compiled shapes
    context_tokens: int | None = None  # long-context target length
    max_batches: dict = field(default_factory=dict)  # engine -> run only its first N batches

    def batches(self) -> list[list[Prompt]]:
        b = self.batch_size
        return [self.prompts[i:i + b] for i in range(0, len(self.prompts) - b + 1, b)]


def assign_shapes(workloads: Sequence[Workload], engines: dict, encode) -> dict[str, dict]:
    """One (prompt_pad, cache_len) per (group, batch size, max_new_tokens), over all engines.

    `encode(prompt) -> ids`. Returns {workload name: {"prompt_pad", "cache_len"}}.
    """
    scratch = max([e.scratch() for e in engines.values() if isinstance(e, EagleEngine)] or [2])
    keys: dict[tuple, list[int]] = {}
    for w in workloads:
        lens = [len(encode(p)) for p in w.prompts]
        keys.setdefault((w.group or w.name, w.batch_size, w.max_new_tokens), []).extend(lens)
    shapes = {}
    for key, lens in keys.items():
        mx = max(lens)
        pad = prompt_bucket(mx)
        cache_len = 64 * math.ceil((max(pad, mx + key[2]) + scratch) / 64)
        shapes[key] = {"prompt_pad": pad, "cache_len": cache_len}
    return {w.name: shapes[(w.group or w.name, w.batch_size, w.max_new_tokens)] for w in workloads}


class Log:
    def __init__(self, stream=sys.stderr):
        self.t0 = time.perf_counter()
        self.stream = stream

    def __call__(self, msg: str):
        print(f"[bench {time.perf_counter() - self.t0:7.1f}s] {msg}", file=self.stream, flush=True)


def run_workload(w: Workload, engines: dict, encode, *, rounds: int, shape: dict | None = None,
                 compiled: dict | None = None, seed: int = 0, log=None) -> dict:
    """Warm-up + interleaved timed rounds; returns the workload's JSON record."""
    log = log or Log()
    load_start = _loadavg()
    compiled = {} if compiled is None else compiled
    batches = w.batches()
    if not batches:
        raise ValueError(f"workload {w.name}: {len(w.prompts)} prompts, fewer than batch size {w.batch_size}")
    ids = [[encode(p) for p in b] for b in batches]
    names = [n for n in w.engines if engines[n].max_batch is None or w.batch_size <= engines[n].max_batch]
    skipped = [n for n in w.engines if n not in names]
    compile_s: dict[str, float | None] = {}
    for n in names:
        e = engines[n]
        key = (n, w.batch_size, w.temperature > 0)
        if isinstance(e, EagleEngine) and shape is not None:
            key = key + e.set_shape(shape["prompt_pad"], shape["cache_len"], w.max_new_tokens)
        if key in compiled:
            compile_s[n] = None  # already compiled for an earlier workload
            continue
        first = e.run(ids[0], WARMUP_TOKENS, w.temperature, seed)
        second = e.run(ids[0], WARMUP_TOKENS, w.temperature, seed)
        compiled[key] = compile_s[n] = max(first.wall_s - second.wall_s, 0.0)
        log(f"{w.name}: warm-up {n}: compile {compile_s[n]:.1f}s")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    memory: dict[str, dict] = {}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for bi, batch_ids in enumerate(ids):
            run_seed = seed + 1000 * r + bi
            active = [n for n in order if bi < w.max_batches.get(n, len(ids))]
            for n in active:
                rec = engines[n].run(batch_ids, w.max_new_tokens, w.temperature, run_seed)
                runs[n].append({"round": r, "batch": bi, "wall_s": rec.wall_s, "ttft_s": rec.ttft_s,
                                "tokens": [len(t) for t in rec.token_ids], "stats": rec.stats,
                                "token_ids": rec.token_ids})
                memory[n] = peak_memory()
            line = ", ".join(f"{n} {sum(runs[n][-1]['tokens']) / runs[n][-1]['wall_s']:.1f}" for n in names
                             if n in active)
            log(f"{w.name}: round {r} batch {bi}: tok/s {line}")
    base = names[0]
    out_engines = {}
    for n in names:
        out_engines[n] = summarize_engine(runs[n], runs[base], greedy=w.temperature == 0,
                                          is_baseline=n == base)
        out_engines[n].update(engines[n].describe())
        out_engines[n]["compile_s"] = compile_s.get(n)
        out_engines[n]["memory"] = memory.get(n, {})
    for n in names:
        for run in runs[n]:
            run.pop("token_ids", None)
    return {
        "name": w.name, "dataset": w.dataset, "batch_size": w.batch_size,
        "temperature": w.temperature, "max_new_tokens": w.max_new_tokens,
        "context_tokens": w.context_tokens, "rounds": rounds,
        "num_prompts": len(w.prompts), "num_batches": len(batches),
        "prompt_ids": [p.id for p in w.prompts],
        "prompt_tokens": [len(x) for b in ids for x in b],
        "shape": shape, "baseline": base, "engines": out_engines, "skipped_engines": skipped,
        "load_average_start": load_start, "load_average_end": _loadavg(),
    }


def _loadavg():
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):
        return None


def _aggregate_acceptance(runs: list[dict]) -> dict | None:
    stats = [r["stats"] for r in runs if r.get("stats")]
    if not stats:
        return None
    steps = sum(s["num_verify_steps"] for s in stats)
    accepted = sum(s["accepted_tokens"] for s in stats)
    depth = max(len(s["per_position_acceptance"]) for s in stats)
    per_pos = np.zeros(depth)
    hist = np.zeros(depth + 1)
    for s in stats:
        pp = np.asarray(s["per_position_acceptance"], float)
        per_pos[:len(pp)] += pp * s["num_verify_steps"]
        h = np.asarray(s["accepted_histogram"], float)
        hist[:len(h)] += h
    return {
        "num_verify_steps": steps, "accepted_tokens": accepted,
        "acceptance_length": 1.0 + accepted / steps if steps else None,
        "draft_acceptance_rate": accepted / (steps * depth) if steps and depth else None,
        "per_position_acceptance": (per_pos / steps).tolist() if steps else [],
        "accepted_histogram": hist.astype(int).tolist(),
    }


def summarize_engine(runs: list[dict], base_runs: list[dict], *, greedy: bool, is_baseline: bool) -> dict:
    """Totals of `runs`; speedups against the baseline's runs of the same (round, batch) only."""
    tokens = sum(sum(r["tokens"]) for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    per_request = [t / r["wall_s"] for r in runs for t in r["tokens"]]
    keys = {(r["round"], r["batch"]) for r in runs}
    matched = [r for r in base_runs if (r["round"], r["batch"]) in keys]
    base_tokens = sum(sum(r["tokens"]) for r in matched)
    base_wall = sum(r["wall_s"] for r in matched)
    total_tps = tokens / wall if wall else 0.0
    base_tps = base_tokens / base_wall if base_wall else 0.0
    by_key = {(r["round"], r["batch"]): r for r in base_runs}
    paired, matches, rows = [], 0, 0
    for r in runs:
        b = by_key.get((r["round"], r["batch"]))
        if b is None:
            continue
        tps, btps = sum(r["tokens"]) / r["wall_s"], sum(b["tokens"]) / b["wall_s"]
        if btps > 0:
            paired.append(tps / btps)
        if greedy:
            for x, y in zip(r["token_ids"], b["token_ids"]):
                rows += 1
                matches += int(x == y)
    ttfts = [r["ttft_s"] for r in runs if r.get("ttft_s") is not None]
    # Decoding alone: the tokens after each row's first over the time after the first token.
    timed = [r for r in runs if r.get("ttft_s") is not None and r["wall_s"] > r["ttft_s"]]
    decode_s = sum(r["wall_s"] - r["ttft_s"] for r in timed)
    decode_tokens = sum(sum(r["tokens"]) - len(r["tokens"]) for r in timed)
    return {
        "tokens": tokens, "wall_s": wall,
        "tokens_per_s_total": total_tps,
        "tokens_per_s_per_request": statistics.mean(per_request) if per_request else 0.0,
        "tokens_per_s_median_run": statistics.median(sum(r["tokens"]) / r["wall_s"] for r in runs),
        "baseline_tokens_per_s_matched": base_tps,
        "speedup": 1.0 if is_baseline else (total_tps / base_tps if base_tps else None),
        "speedup_paired_median": 1.0 if is_baseline else (statistics.median(paired) if paired else None),
        "speedup_paired_min": None if is_baseline or not paired else min(paired),
        "speedup_paired_max": None if is_baseline or not paired else max(paired),
        "ttft_s_median": statistics.median(ttfts) if ttfts else None,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None,
        "acceptance": _aggregate_acceptance(runs),
        "greedy_match_rate": (matches / rows if rows else None) if greedy and not is_baseline else None,
        "runs": runs,
    }


# ----------------------------------------------------------------------------- results


def write_result(result: dict, out_dir: str | None = None, *, prefix: str = "bench") -> str:
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = machine_slug(result["machine"])
    path = os.path.join(out_dir, f"{prefix}-{stamp}-{slug}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, default=_json_default)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o)}")


def result_header(suite: str, argv=None) -> dict:
    """The fields every result JSON starts with."""
    import jax

    return {"suite": suite, "date": timestamp(), "command": command_line(argv),
            "cwd": os.getcwd(), "machine": machine_info(), "jax_version": jax.__version__,
            "versions": library_versions()}
