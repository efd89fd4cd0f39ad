"""Device check: the first thing to run when a GPU or TPU is lent (issue 20).

    scripts/device_check.sh                    # on the device: about 4 minutes, one JSON + a summary
    scripts/device_check.sh --dry-run          # the same code on CPU, tiny shapes, Pallas interpreted
    eagle-jax bench --suite device [--dry-run]   # the same, where the package is installed
    python -m eagle_jax.benchmarks.device_check --output-dir DIR [--budget-s 240] [--impls xla,pallas]

Everything runs on random weights made on the device, shaped like
SmolLM2-135M (no checkpoint, no tokenizer: the device image has jax and
flax but no gguf / transformers / tokenizers, and nothing large travels):

1. kernels: `fused_norm_matmul` with the Pallas impl of the backend
   against the XLA impl, both against a float64
   host reference, on decode / verify / lm_head / EAGLE 3.1 FC / prefill
   shapes, float32 and bfloat16: max abs and relative error, compile and
   per-call time.
2. equivalence: greedy chain and tree speculation against plain greedy
   decoding (the `Generator`, token ids in and out) for every loop impl, on
   SmolLM2's body with an 8-token vocabulary (so random drafts are accepted
   and the commit / compaction paths run) at batch 3. Where a row differs,
   the target's logits at the first differing position (teacher-forced on
   plain's prefix) say whether it was a near-tie: the speculative token's
   logit within `tie_gap` of the top-1.
3. speed: plain, chain and tree at batch 1 on the full SmolLM2 shapes
   (vocabulary 49152): decode tokens/s, step time, and the break-even tau
   (speculative step time / plain step time: the acceptance length a trained
   drafter must reach to pay). The random drafter accepts almost nothing, so
   its own tokens/s is a floor, not EAGLE's speedup. The outputs are compared too.

Sections run in this order (kernels, equivalence per loop impl, speed per
loop impl) while the time budget lasts (later ones are marked skipped); the
JSON (`device_check.json` under --output-dir, default $OUT, else
runs/device_check) is rewritten after each, so a run cut short still leaves
what it measured. Exit status 1 when a kernel is out of tolerance or a row
differs beyond a near-tie.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.config import DrafterConfig, RopeConfig, SpecConfig, TargetConfig
from eagle_jax.models import drafter, target

RESULT_FILE = "device_check.json"

# SmolLM2-135M-Instruct's config.json, as numbers (the checkpoint itself is never read here).
SMOLLM2_135M = TargetConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                            num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                            rms_norm_eps=1e-5, rope=RopeConfig(theta=100000.0), tie_word_embeddings=True,
                            name_or_path="random SmolLM2-135M shapes")
# The dry run's stand-in: the same family, small enough to compile and run in seconds on CPU.
TINY = TargetConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                    rope=RopeConfig(theta=100000.0), tie_word_embeddings=True, name_or_path="random tiny")

# Max |y - ref| / max |ref| against the float64 reference, per input dtype.
KERNEL_TOL = {"float32": 5e-3, "bfloat16": 3e-2}
# Where plain and speculative part: their two tokens' logits (teacher-forced) within this are a near-tie.
TIE_GAP = {"float32": 0.05, "bfloat16": 0.25}


@dataclasses.dataclass(frozen=True)
class Settings:
    dry_run: bool
    dtype: str
    kernel_impl: str  # "pallas" on a device, "interpret" in the dry run
    kernel_targets: tuple  # Pallas kernel bodies to run (None: the backend's)
    kernel_cases: tuple  # (name, M, K, N, segments)
    kernel_dtypes: tuple
    kernel_iters: int
    loop_impls: tuple
    eq_impls: tuple  # the loop impls the equivalence section runs (the speed section runs loop_impls)
    eq_target: TargetConfig
    eq_prompt_lens: tuple
    eq_max_new: int
    speed_target: TargetConfig
    speed_prompt_lens: tuple
    speed_max_new: int
    rounds: int
    chain: SpecConfig
    tree: SpecConfig
    tie_gap: float
    budget_s: float


def _spec(**kw) -> SpecConfig:
    """A SpecConfig that speculates at every batch size."""
    return SpecConfig(**kw, disable_by_batch_size=None)


def _kernel_cases(cfg: TargetConfig, verify_rows: int) -> tuple:
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qkv = cfg.q_size + 2 * cfg.kv_size
    return (("qkv decode", 1, h, qkv, 1), ("gate_up verify", verify_rows, h, 2 * f, 1),
            ("lm_head verify", verify_rows, h, v, 1), ("fc eagle3.1", verify_rows, 3 * h, h, 3),
            ("down verify", verify_rows, f, h, 1), ("gate_up prefill", 256 if h > 64 else 40, h, 2 * f, 1))


def make_settings(dry_run: bool, *, dtype=None, impls=None, budget_s=None, tie_gap=None) -> Settings:
    """The device run's settings, or the dry run's (tiny shapes, interpreted Pallas, CPU)."""
    dtype = dtype or ("float32" if dry_run else "bfloat16")
    if dtype not in KERNEL_TOL:
        raise ValueError(f"dtype must be one of {sorted(KERNEL_TOL)}, got {dtype!r}")
    cfg = TINY if dry_run else SMOLLM2_135M
    if dry_run:  # small envelopes compile faster; the code paths are the same
        chain, tree = _spec(method="chain", num_speculative_tokens=2), _spec(
            method="tree", tree_top_k=2, tree_depth=2, tree_total_tokens=4)
    else:  # the engine's defaults
        chain = _spec(method="chain", num_speculative_tokens=SpecConfig.num_speculative_tokens)
        tree = _spec(method="tree", tree_top_k=SpecConfig.tree_top_k, tree_depth=SpecConfig.tree_depth,
                     tree_total_tokens=SpecConfig.tree_total_tokens)
    cases = _kernel_cases(cfg, tree.tree_total_tokens)
    backend = "cpu" if dry_run else jax.default_backend()
    loop_impls = tuple(impls) if impls else ("xla",) if dry_run else ("xla", "pallas")
    # The Mosaic GPU kernel takes 16-bit dtypes and N a multiple of 64: on a GPU no float32 kernel
    # rows, no Pallas loop in float32, and none on the 8-token equivalence target (the speed section
    # compares Pallas against plain decoding at SmolLM2's shapes).
    on_gpu = backend in ("gpu", "cuda", "rocm")
    if on_gpu and dtype == "float32":
        loop_impls = tuple(i for i in loop_impls if i != "pallas")
    # The equivalence target: SmolLM2's body with an 8-token vocabulary, so random drafts are accepted.
    eq_target = dataclasses.replace(cfg, vocab_size=8, name_or_path=f"{cfg.name_or_path}, vocabulary 8")
    eq = dict(eq_target=eq_target, eq_prompt_lens=(3, 9, 20) if dry_run else (5, 17, 40),
              eq_max_new=20 if dry_run else 48)
    if dry_run:  # the speed section reuses the equivalence shapes: no second set of compiles
        speed = dict(speed_target=eq_target, speed_prompt_lens=eq["eq_prompt_lens"], speed_max_new=eq["eq_max_new"])
    else:
        speed = dict(speed_target=cfg, speed_prompt_lens=(64,), speed_max_new=128)
    return Settings(
        dry_run=dry_run, dtype=dtype, kernel_impl="interpret" if dry_run else "pallas",
        kernel_targets=("gpu", "tpu") if dry_run else (None,),
        kernel_cases=(cases[0], cases[3]) if dry_run else cases,
        kernel_dtypes=("bfloat16",) if dry_run or on_gpu else ("float32", "bfloat16"),
        kernel_iters=2 if dry_run else 20,
        loop_impls=loop_impls, eq_impls=tuple(i for i in loop_impls if not (on_gpu and i == "pallas")),
        **eq, **speed, rounds=1 if dry_run else 3, chain=chain, tree=tree,
        tie_gap=TIE_GAP[dtype] if tie_gap is None else tie_gap,
        budget_s=(120.0 if dry_run else 240.0) if budget_s is None else budget_s)


# ----------------------------------------------------------------------------- models


def drafter_config_for(tcfg: TargetConfig, draft_vocab: int) -> DrafterConfig:
    """An EAGLE 3.1 drafter (fc_norm, norm_output) shaped like one target layer."""
    n = tcfg.num_layers
    aux = tcfg.default_aux_layers() if n >= 8 else (1, n // 2, n - 1)
    return DrafterConfig(hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
                         num_heads=tcfg.num_heads, num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim,
                         vocab_size=tcfg.vocab_size, draft_vocab_size=draft_vocab,
                         target_hidden_size=tcfg.hidden_size, aux_layer_ids=tuple(aux), rope=tcfg.rope,
                         rms_norm_eps=tcfg.rms_norm_eps, max_position_embeddings=tcfg.max_position_embeddings,
                         fc_norm=True, norm_output=True)


def random_models(tcfg: TargetConfig, dtype: str, seed: int, scale: float):
    """(target params, (drafter cfg, params, vocab)), random, made on the default device."""
    vd = max(2, min(tcfg.vocab_size - 2, 8192))
    dcfg = drafter_config_for(tcfg, vd)
    tparams = target.init_params(tcfg, jax.random.PRNGKey(seed), dtype=jnp.dtype(dtype), scale=scale)
    dparams = drafter.init_params(dcfg, jax.random.PRNGKey(seed + 1), dtype=jnp.dtype(dtype), scale=scale)
    ids = jnp.sort(jax.random.permutation(jax.random.PRNGKey(seed + 2), tcfg.vocab_size)[:vd])
    return tparams, (dcfg, dparams, drafter.DraftVocab.from_target_ids(ids, tcfg.vocab_size))


def random_prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


# ----------------------------------------------------------------------------- kernels


def reference_f64(x, g, w, *, eps: float, segments: int, bias=None) -> np.ndarray:
    """concat_s(rms_norm(x_s) * g_s) @ w (+ bias) in float64 on the host."""
    x = np.asarray(x, np.float64)
    k = x.shape[-1]
    xs = x.reshape(*x.shape[:-1], segments, k // segments)
    normed = xs / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + eps)
    y = normed.reshape(x.shape) * np.asarray(g, np.float64).reshape(k) @ np.asarray(w, np.float64)
    return y if bias is None else y + np.asarray(bias, np.float64)


def error_stats(y, ref) -> dict:
    """max |y - ref| and that over max |ref| (y cast to float64)."""
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    err = float(np.max(np.abs(y - ref))) if y.size else 0.0
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    return {"max_abs_err": err, "max_rel_err": err / scale if scale else err,
            "finite": bool(np.all(np.isfinite(y)))}


def _timed(fn, args, iters: int) -> tuple[object, float, float]:
    """(output, first-call seconds (compile + run), median seconds of `iters` more calls)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, first, float(np.median(times)) if times else first


def _kernel_inputs(m, k, n, segments, dtype, seed):
    kx, kg, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = (2.0 * jax.random.normal(kx, (m, k))).astype(dtype)
    g = (1.0 + 0.1 * jax.random.normal(kg, (k,))).astype(dtype)
    w = (0.05 * jax.random.normal(kw, (k, n))).astype(dtype)
    return x, g, w


def check_kernel_case(case, dtype: str, settings: Settings, target_body=None, seed: int = 0) -> list[dict]:
    """One shape at one dtype: XLA, then the Pallas impl."""
    from eagle_jax.kernels import fused_norm_matmul

    name, m, k, n, segments = case
    eps = 1e-5
    x, g, w = _kernel_inputs(m, k, n, segments, jnp.dtype(dtype), seed)
    ref = reference_f64(x.astype(jnp.float32), g.astype(jnp.float32), w.astype(jnp.float32),
                        eps=eps, segments=segments)
    tol = KERNEL_TOL[dtype]
    rows, xla_out = [], None
    for impl in ("xla", settings.kernel_impl):
        row = {"case": name, "shape": [m, k, n], "segments": segments, "dtype": dtype, "impl": impl,
               "target": target_body}
        try:
            tgt = {} if impl == "xla" else {"target": target_body}
            fn = jax.jit(lambda x, g, w, impl=impl, tgt=tgt: fused_norm_matmul(
                x, g, w, eps=eps, segments=segments, impl=impl, **tgt))
            y, first, per_call = _timed(fn, (x, g, w), settings.kernel_iters)
            row.update(error_stats(y, ref), compile_s=round(first, 4), call_s=per_call)
            if xla_out is None:
                xla_out = y
            else:
                row["max_abs_diff_vs_xla"] = error_stats(y, np.asarray(xla_out, np.float64))["max_abs_err"]
            row["ok"] = row["finite"] and row["max_rel_err"] <= tol
        except Exception as e:  # noqa: BLE001 - a first device run must report, not stop
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        rows.append(row)
    return rows


def run_kernels(settings: Settings, out: dict, deadline: float) -> None:
    rows = out.setdefault("kernels", [])
    for tgt in settings.kernel_targets:
        for dtype in settings.kernel_dtypes:
            for i, case in enumerate(settings.kernel_cases):
                if time.perf_counter() > deadline:
                    out.setdefault("skipped", []).append(f"kernels {case[0]} {dtype}: over the time budget")
                    continue
                rows.extend(check_kernel_case(case, dtype, settings, tgt, seed=i))


# ----------------------------------------------------------------------------- decoding


def first_divergence(a, b) -> int | None:
    """The first index where two token lists differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def teacher_forced_logits(gen, ids: list[int], bucket: int = 32) -> np.ndarray:
    """The target's float32 logits after `ids`, in one forward with the generator's params and impl.
    The ids are right-padded to a multiple of `bucket` (causal: the padding is never attended)
    so that prefixes of nearby lengths share one compile."""
    n = len(ids)
    width = bucket * -(-n // bucket)
    toks = jnp.asarray([ids + [0] * (width - n)], jnp.int32)
    cache = target.create_cache(gen.target_cfg, 1, width, gen.target_params["embed"].dtype)
    pos = jnp.arange(width, dtype=jnp.int32)[None]
    model = target.Target(gen.target_cfg, gen.target_params)
    h, _, _ = model(toks, pos, cache, impl=gen.impl)
    return np.asarray(model.logits(h[:, n - 1], impl=gen.impl)[0])


def canary(gen, prompts, plain_ids) -> dict:
    """The comparison must see a difference: plain's first row with one token changed
    (tie gap 0) has to come back as a MISMATCH at that position."""
    row = plain_ids[0]
    j = len(row) // 2
    changed = row[:j] + [(row[j] + 1) % gen.target_cfg.vocab_size] + row[j + 1:]
    (got,) = compare_rows(gen, prompts[:1], [row], [changed], tie_gap=0.0)
    return {"position": j, "caught": got["verdict"] == "MISMATCH" and got.get("position") == j,
            "plain_is_top1": got.get("plain_below_top1") == 0.0, "result": got}


def classify_divergence(logits: np.ndarray, plain_tok: int, spec_tok: int | None, tie_gap: float) -> dict:
    """Near-tie or mismatch at the first differing position, from the target's logits there.

    The teacher-forced forward is a third rounding of the same sums (one pass
    over the whole prefix), so either engine's token may be its top-1: a
    near-tie is the two tokens' logits within `tie_gap` of each other."""
    top2 = np.argsort(logits)[::-1][:2]
    info = {"top2_ids": [int(t) for t in top2], "top2_gap": float(logits[top2[0]] - logits[top2[1]]),
            "plain_token": plain_tok, "spec_token": spec_tok}
    if spec_tok is None:
        return {**info, "verdict": "MISMATCH", "why": "the speculative output is shorter"}
    between = float(abs(logits[plain_tok] - logits[spec_tok]))
    verdict = "near-tie" if between <= tie_gap else "MISMATCH"
    return {**info, "plain_below_top1": float(logits[top2[0]] - logits[plain_tok]),
            "spec_below_top1": float(logits[top2[0]] - logits[spec_tok]), "logit_gap_between": between,
            "verdict": verdict}


def compare_rows(gen, prompts, plain_ids, spec_ids, tie_gap: float) -> list[dict]:
    """Per row: "equal", or where plain and speculative part and whether that was a near-tie."""
    rows = []
    for prompt, p, s in zip(prompts, plain_ids, spec_ids):
        j = first_divergence(s, p)
        if j is None:
            rows.append({"verdict": "equal", "tokens": len(p)})
            continue
        spec_tok = s[j] if j < len(s) else None
        plain_tok = p[j] if j < len(p) else None
        if plain_tok is None:
            rows.append({"verdict": "MISMATCH", "position": j, "why": "the speculative output is longer"})
            continue
        info = classify_divergence(teacher_forced_logits(gen, prompt + p[:j]), plain_tok, spec_tok, tie_gap)
        rows.append({"position": j, "tokens": len(p), **info})
    return rows


def _generate(gen, prompts, max_new: int, rounds: int) -> dict:
    """Greedy generation: the first (compiling) call's ids, then `rounds` timed calls."""
    t0 = time.perf_counter()
    res = gen.generate(prompts, max_new_tokens=max_new, temperature=0.0)
    first_s = time.perf_counter() - t0
    runs = [gen.generate(prompts, max_new_tokens=max_new, temperature=0.0) for _ in range(rounds)]
    best = min(runs, key=lambda r: r.timings["decode_s"]) if runs else res
    if gen.speculative and res.spec_stats is not None:
        iterations = int(np.max(res.spec_stats.steps))
    else:
        iterations = max(len(t) for t in res.token_ids) - 1
    decode_s = best.timings["decode_s"]
    return {"ids": res.token_ids, "first_call_s": round(first_s, 3), "decode_s": decode_s,
            "prefill_s": best.timings["prefill_s"], "iterations": iterations,
            "step_ms": 1e3 * decode_s / max(iterations, 1),
            "decode_tokens_per_s": best.timings["decode_tokens_per_s"], "tokens_per_s": best.tokens_per_s,
            "tau": res.stats.get("acceptance_length"), "accepted_tokens": res.stats.get("accepted_tokens")}


def _engines(tcfg, tparams, bundle, settings: Settings, impl: str) -> dict:
    from eagle_jax.generate import Generator

    kw = dict(impl=impl, unroll_layers=False)  # the accelerator default: layers under lax.scan
    return {"plain": Generator(tcfg, tparams, **kw),
            "chain": Generator(tcfg, tparams, drafter=bundle, spec=settings.chain, **kw),
            "tree": Generator(tcfg, tparams, drafter=bundle, spec=settings.tree, **kw)}


def run_decoding(settings: Settings, tcfg: TargetConfig, prompts, max_new: int, rounds: int, scale: float,
                 impl: str, deadline: float) -> dict:
    """plain, chain and tree on one target: timings, and each speculative output against plain's."""
    tparams, bundle = random_models(tcfg, settings.dtype, seed=0, scale=scale)
    engines = _engines(tcfg, tparams, bundle, settings, impl)
    result = {"impl": impl, "target": tcfg.name_or_path, "vocab_size": tcfg.vocab_size,
              "batch": len(prompts), "prompt_lens": [len(p) for p in prompts], "max_new_tokens": max_new}
    runs = {}
    for name, gen in engines.items():
        if time.perf_counter() > deadline:
            result.setdefault("skipped", []).append(name)
            continue
        try:
            runs[name] = _generate(gen, prompts, max_new, rounds)
        except Exception as e:  # noqa: BLE001
            runs[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    plain = runs.get("plain", {})
    for name, r in runs.items():
        if name == "plain" or "ids" not in r or "ids" not in plain:
            continue
        r["rows"] = compare_rows(engines["plain"], prompts, plain["ids"], r["ids"], settings.tie_gap)
        r["break_even_tau"] = r["step_ms"] / plain["step_ms"] if plain.get("step_ms") else None
    if "ids" in plain and time.perf_counter() <= deadline:
        result["canary"] = canary(engines["plain"], prompts, plain["ids"])
    for r in runs.values():
        r.pop("ids", None)
    result["engines"] = runs
    return result


def run_equivalence(settings: Settings, out: dict, deadline: float, impl: str) -> None:
    tcfg = settings.eq_target
    prompts = random_prompts(tcfg.vocab_size, settings.eq_prompt_lens, seed=1)
    out.setdefault("equivalence", []).append(
        run_decoding(settings, tcfg, prompts, settings.eq_max_new, 0, 0.1, impl, deadline))


def run_speed(settings: Settings, out: dict, deadline: float, impl: str) -> None:
    tcfg = settings.speed_target
    prompts = random_prompts(tcfg.vocab_size, settings.speed_prompt_lens, seed=2)
    out.setdefault("speed", []).append(
        run_decoding(settings, tcfg, prompts, settings.speed_max_new, settings.rounds, 0.02, impl, deadline))


# ----------------------------------------------------------------------------- report


def _jaxlib_version() -> str | None:
    try:
        import jaxlib
    except ImportError:
        return None
    return getattr(jaxlib, "__version__", None)


def environment(dry_run: bool = False) -> dict:
    dev = jax.devices("cpu")[0] if dry_run else jax.devices()[0]
    return {"backend": dev.platform, "default_backend": jax.default_backend(),
            "device": getattr(dev, "device_kind", str(dev)),
            "num_devices": jax.device_count(), "jax": jax.__version__,
            "jaxlib": _jaxlib_version(),
            "python": platform.python_version(), "host": platform.node(),
            "kernel_impl_env": os.environ.get("EAGLE_JAX_KERNEL_IMPL"),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def failures(out: dict) -> list[str]:
    """What makes the check fail: kernels out of tolerance, rows beyond a near-tie, errors."""
    bad = [f"kernel {r['case']} {r['dtype']} {r['impl']}"
           + (f" ({r['target']})" if r.get("target") else "") + (f": {r['error']}" if "error" in r else
                                                                  f": rel err {r['max_rel_err']:.2e}")
           for r in out.get("kernels", []) if not r["ok"]]
    for section in ("equivalence", "speed"):
        for res in out.get(section, []):
            for name, e in res["engines"].items():
                if "error" in e:
                    bad.append(f"{section} {res['impl']} {name}: {e['error']}")
                for i, row in enumerate(e.get("rows", [])):
                    if row["verdict"] == "MISMATCH":
                        bad.append(f"{section} {res['impl']} {name} row {i}: differs from plain at "
                                   f"position {row.get('position')} beyond a near-tie")
    return bad


def _rows_line(rows) -> str:
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("equal", "near-tie", "MISMATCH")}
    line = "/".join(f"{n} {v}" for v, n in counts.items() if n)
    gaps = [r["logit_gap_between"] for r in rows if "logit_gap_between" in r]
    return line + (f", widest gap {max(gaps):.3f}" if gaps else "")


def summary_lines(out: dict) -> list[str]:
    env = out["environment"]
    lines = [f"device check{' (dry run)' if out['dry_run'] else ''}: {env['backend']} ({env['device']}), "
             f"jax {env['jax']}, {out['dtype']}, {out.get('wall_s', 0):.0f} s"]
    ks = out.get("kernels", [])
    if ks:
        ok = sum(r["ok"] for r in ks)
        pal = [r for r in ks if r["impl"] != "xla" and "error" not in r]
        worst = max(pal, key=lambda r: r["max_rel_err"], default=None)
        line = f"kernels: {ok}/{len(ks)} within tolerance"
        if worst:
            line += f"; worst {worst['impl']} rel err {worst['max_rel_err']:.1e} ({worst['case']} {worst['dtype']})"
        lines.append(line)
        shown = out["dtype"] if any(r["dtype"] == out["dtype"] for r in ks) else ks[-1]["dtype"]
        for r in ks:
            if r["impl"] != "xla" and r["dtype"] == shown and "error" not in r:
                x = next((q for q in ks if q["impl"] == "xla" and q["case"] == r["case"]
                          and q["dtype"] == r["dtype"] and q["target"] == r["target"]), None)
                if x and "call_s" in x:
                    lines.append(f"  {r['case']:16s} {r['impl']}{'/' + r['target'] if r['target'] else ''} "
                                 f"{1e6 * r['call_s']:8.0f} us, xla {1e6 * x['call_s']:8.0f} us")
    for section in ("equivalence", "speed"):
        for res in out.get(section, []):
            parts = []
            for name, e in res["engines"].items():
                if "error" in e:
                    parts.append(f"{name} ERROR")
                    continue
                if section == "speed":
                    s = f"{name} {e['decode_tokens_per_s']:.1f} tok/s ({e['step_ms']:.1f} ms/step"
                    if e.get("tau") is not None:
                        s += f", tau {e['tau']:.2f}, break-even tau {e['break_even_tau']:.2f}"
                    s += ")"
                else:  # compile-inclusive timings: only the outcome
                    s = name + ("" if e.get("tau") is None else f" tau {e['tau']:.2f}, "
                                f"{e['accepted_tokens']} drafts accepted")
                if e.get("rows"):
                    s += f" [{_rows_line(e['rows'])}]"
                parts.append(s)
            if "canary" in res:
                parts.append("changed-token canary " + ("caught" if res["canary"]["caught"] else "MISSED"))
            lines.append(f"{section} {res['impl']}, batch {res['batch']}, V={res['vocab_size']}: " + "; ".join(parts))
    lines += [f"skipped: {s}" for s in out.get("skipped", [])]
    bad = failures(out)
    lines.append("result: PASS" if not bad else f"result: FAIL ({len(bad)}): " + "; ".join(bad[:5]))
    return lines


def _write(out: dict, path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=1, default=str)
        f.write("\n")
    os.replace(path + ".tmp", path)


def run(settings: Settings, output_dir: str, log=print) -> dict:
    """All sections in order within the budget; the JSON is rewritten after each.
    The dry run places everything on the CPU, whatever the default backend."""
    if settings.dry_run:
        with jax.default_device(jax.devices("cpu")[0]):
            return _run(settings, output_dir, log)
    return _run(settings, output_dir, log)


def _run(settings: Settings, output_dir: str, log) -> dict:
    t0 = time.perf_counter()
    deadline = t0 + settings.budget_s
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, RESULT_FILE)
    out = {"suite": "device", "dry_run": settings.dry_run, "dtype": settings.dtype,
           "environment": environment(settings.dry_run), "settings": dataclasses.asdict(settings), "partial": True}
    left_out = [i for i in settings.loop_impls if i not in settings.eq_impls]
    if left_out:
        out.setdefault("skipped", []).append(
            f"equivalence {','.join(left_out)}: the 8-token target is a shape the Mosaic GPU kernel refuses "
            f"(N % 64); the speed section compares it with plain decoding at SmolLM2's shapes")
    steps = [("kernels", lambda: run_kernels(settings, out, deadline))]
    # Correctness on every impl first, then speed: what a short budget cuts is the least needed.
    steps += [(f"equivalence {impl}", lambda impl=impl: run_equivalence(settings, out, deadline, impl))
              for impl in settings.eq_impls]
    steps += [(f"speed {impl}", lambda impl=impl: run_speed(settings, out, deadline, impl))
              for impl in settings.loop_impls]
    for name, fn in steps:
        if time.perf_counter() > deadline:
            out.setdefault("skipped", []).append(f"{name}: over the {settings.budget_s:.0f} s budget")
            continue
        t = time.perf_counter()
        fn()
        log(f"[device-check] {name}: {time.perf_counter() - t:.1f} s")
        out["wall_s"] = time.perf_counter() - t0
        _write(out, path)
    out["partial"] = False
    out["wall_s"] = time.perf_counter() - t0
    out["failures"] = failures(out)
    _write(out, path)
    out["path"] = path
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="device_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, Pallas under the interpreter")
    p.add_argument("--output-dir", default=None, help="where device_check.json goes (default $OUT, "
                                                      "else runs/device_check)")
    p.add_argument("--dtype", choices=sorted(KERNEL_TOL), default=None,
                   help="decoding dtype (default bfloat16 on a device, float32 in the dry run)")
    p.add_argument("--impls", default=None, help="loop impls, comma-separated (default xla,pallas; "
                                                 "dry run xla,interpret)")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting sections after this "
                                                                "(default 240; dry run 120)")
    p.add_argument("--tie-gap", type=float, default=None, help="near-tie logit distance (default per dtype)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and jax.default_backend() == "cpu":
        raise SystemExit("device_check: the backend is CPU; pass --dry-run, or run it on a GPU or TPU")
    impls = [s.strip() for s in args.impls.split(",") if s.strip()] if args.impls else None
    settings = make_settings(args.dry_run, dtype=args.dtype, impls=impls, budget_s=args.budget_s,
                             tie_gap=args.tie_gap)
    output_dir = args.output_dir or os.environ.get("OUT") or os.path.join("runs", "device_check")
    out = run(settings, output_dir, log=lambda s: print(s, file=sys.stderr, flush=True))
    print("\n".join(summary_lines(out)))
    print(f"json: {out['path']}")
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
