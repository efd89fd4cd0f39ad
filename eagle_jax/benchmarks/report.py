"""Render docs/benchmarks.md (tables + matplotlib PNGs) from benchmarks/results/*.json.

    eagle-jax bench --suite report [--output-dir DIR] [--docs PATH]
    python -m eagle_jax.benchmarks.report

For each suite (speed, drift, plain_vs_transformers, serve, draft_policy, step_cost) the newest result per
(mode, machine) is rendered; older files are listed at the end. Every table
is captioned with the command, the machine and the date of its run.
Hand-written commentary lives in benchmarks/results/analysis.md and is
included verbatim under "Analysis". The learning curve
(benchmarks/results/learning_curve.jsonl, benchmarks/learning_curve.py) is
rendered whole: a table of every point and learning_curve.png.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sys

from eagle_jax.benchmarks.harness import RESULTS_DIR, machine_slug
from eagle_jax.runtime import describe_machine

DEFAULT_DOCS = os.path.join("docs", "benchmarks.md")  # under the working directory (a checkout's docs/)
ANALYSIS_FILE = "analysis.md"


# ----------------------------------------------------------------------------- loading


RESULT_SUFFIXES = (".json.gz", ".json")  # older results are committed gzipped


def result_stem(path: str) -> str:
    """A result file's path without its suffix (the prefix of its PNGs)."""
    return next(path[: -len(s)] for s in RESULT_SUFFIXES + ("",) if path.endswith(s))


def load_results(results_dir: str) -> list[dict]:
    out = []
    paths = sorted(p for s in RESULT_SUFFIXES for p in glob.glob(os.path.join(results_dir, "*" + s)))
    for path in paths:
        try:
            with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
                r = json.load(f)
        except (OSError, EOFError, json.JSONDecodeError):
            continue
        if not isinstance(r, dict) or "suite" not in r or "machine" not in r:
            continue
        r["_path"] = path
        out.append(r)
    return out


def newest(results: list[dict]) -> tuple[list[dict], list[dict]]:
    """(newest per (suite, mode, machine), the rest)."""
    best: dict = {}
    for r in results:
        key = (r["suite"], r.get("mode"), machine_slug(r["machine"]))
        if key not in best or (r.get("date", ""), r["_path"]) > (best[key].get("date", ""), best[key]["_path"]):
            best[key] = r
    chosen = sorted(best.values(), key=lambda r: (r["suite"], r.get("mode") or "", r.get("date", "")))
    rest = [r for r in results if all(r is not c for c in chosen)]
    return chosen, rest


# ----------------------------------------------------------------------------- formatting


def fmt(x, nd=2, dash="–"):
    if x is None:
        return dash
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if x != x:
            return dash
        return f"{x:.{nd}f}"
    return str(x)


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines)


def caption(r: dict) -> str:
    m = r["machine"]
    desc = m.get("description") or describe_machine(m)
    return (f"*Command:* `{r.get('command', '?')}` — *machine:* {desc} — *date:* {r.get('date', '?')} — "
            f"*jax* {r.get('jax_version', '?')} — *file:* `{os.path.basename(r['_path'])}`")


def _rel(path: str, docs_path: str) -> str:
    return os.path.relpath(path, os.path.dirname(os.path.abspath(docs_path))).replace(os.sep, "/")


def _png(r: dict, what: str) -> str:
    return f"{result_stem(r['_path'])}-{what}.png"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ----------------------------------------------------------------------------- plain vs transformers


def render_plain_vs_transformers(r: dict) -> str:
    out = [f"### Plain greedy decoding: eagle-jax vs transformers ({r.get('date', '?')[:10]})", "", caption(r), ""]
    la = (r.get("machine") or {}).get("load_average")
    if la:
        out.append(f"Load average when the run started: {', '.join(f'{x:.1f}' for x in la)} "
                   f"(1, 5, 15 min) on {r['machine'].get('cpu_affinity') or r['machine'].get('cpu_count')} cores.")
        out.append("")
    s = r.get("settings", {})
    out.append(f"SmolLM2-135M-Instruct, float32 weights from the same GGUF in both engines, batch 1, greedy, "
               f"{s.get('max_new_tokens')} new tokens, a {s.get('prompt_tokens')}-token chat prompt, "
               f"{len(r.get('rounds', []))} interleaved timed rounds.")
    out.append("")
    ratio = r.get("ratio_paired_median")
    rows = [
        ["eagle-jax plain tokens/s (median)", fmt(r.get("eagle_jax_tokens_per_s"), 1), ""],
        ["transformers `generate` tokens/s (median)", fmt(r.get("transformers_tokens_per_s"), 1),
         f"{r.get('transformers_threads') or '?'} thread(s); calibration tok/s by threads: "
         + (", ".join(f"{k}: {v:.1f}" for k, v in r["transformers_thread_calibration"].items())
            if r.get("transformers_thread_calibration") else "–")],
        ["ratio eagle-jax / transformers (paired median)", fmt(ratio), f">= {fmt(r.get('target_ratio'), 1)}: "
         + ("met" if r.get("ratio_target_met") else "**not met**")],
        ["ratio of medians", fmt(r.get("ratio_of_medians")), ""],
        ["identical token sequences (rounds)", f"{r.get('same_tokens_rounds')} / {len(r.get('rounds', []))}",
         f"common prefix {r.get('common_prefix_tokens')} tokens"],
        ["eagle-jax TTFT s / transformers TTFT s", f"{fmt(r.get('eagle_jax_ttft_s'), 3)} / "
         f"{fmt(r.get('transformers_ttft_s'), 3)}", ""],
        ["eagle-jax first call (compile + run) s", fmt(r.get("eagle_jax_first_call_s")), ""],
        ["eagle-jax compile_s (first − second call)", fmt(r.get("eagle_jax_compile_s")),
         "persistent cache " + ("cold (fresh directory)" if r.get("compile_cache") == "fresh" else "as found")],
        ["eagle-jax second call s", fmt(r.get("eagle_jax_second_call_s")), ""],
        ["warm start s (fresh `eagle-jax generate --json` process, cache filled)", fmt(r.get("warm_start_s")),
         f"< {fmt(r.get('warm_start_target_s'), 0)}: " + ("met" if r.get("warm_start_target_met") else "**not met**")],
    ]
    out.append(table(["metric", "value", "target / note"], rows))
    out.append("")
    if r.get("warm_start_command"):
        out.append(f"Warm-start command: `{r['warm_start_command']}`.")
        out.append("")
    b = r.get("warm_start_breakdown") or {}
    if b and "import_jax_s" in b:
        out.append("Where a warm start goes (a fresh child process, same cache):")
        out.append("")
        out.append(caption(r))
        out.append("")
        out.append(table(["phase", "s"], [
            ["import jax", fmt(b.get("import_jax_s"))],
            ["import eagle_jax.generate", fmt(b.get("import_eagle_jax_s"))],
            ["load_target (conversion cache + tokenizer)", fmt(b.get("load_target_s"))],
            ["Generator + tokenise", fmt(b.get("generator_and_tokenize_s"))],
            ["first generate (cached executables loaded + run)", fmt(b.get("first_generate_s"))],
            ["second generate (run only)", fmt(b.get("second_generate_s"))],
            ["whole child process", fmt(b.get("process_wall_s"))],
        ]))
        out.append("")
    p = r.get("profile") or {}
    if p:
        out.append("Decode-step profile (batch 1, one token, float32):")
        out.append("")
        out.append(caption(r))
        out.append("")
        out.append(table(["quantity", "value"], [
            ["one jitted target step, isolated (median ms)", fmt(p.get("step_ms_median"), 1)],
            *[[f"decoding loop per token, {k}-slot KV-cache buffer (ms)", fmt(v, 1)]
              for k, v in sorted((p.get("loop_ms_per_token_by_cache_len") or {}).items(), key=lambda kv: int(kv[0]))],
            ["weight matmuls only, 30 layers + lm_head (ms)", fmt(p.get("matmuls_only_ms"), 1)],
            ["lm_head matmul only (ms)", fmt(p.get("lm_head_only_ms"), 1)],
            ["per token inside the decoding loop (ms)", fmt(p.get("loop_ms_per_token"), 1)],
            ["transformers per token (ms)", fmt(p.get("transformers_ms_per_token"), 1)],
            ["bytes read per step (weights + KV cache, MB)",
             fmt(((p.get("weight_bytes") or 0) + (p.get("kv_cache_bytes_read") or 0)) / 1e6, 0)],
            ["memory bandwidth, numpy copy (GB/s)", fmt(p.get("numpy_copy_gbs"), 1)],
            ["memory bandwidth, XLA x+1 (GB/s)", fmt(p.get("xla_add_gbs"), 1)],
            ["weight-read roofline per token (ms)", fmt(p.get("roofline_ms_per_token"), 1)],
            ["effective bandwidth of the isolated step (GB/s)", fmt(p.get("step_bandwidth_gbs"), 1)],
        ]))
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------- speed


def _drafter_cell(e: dict) -> str:
    d = e.get("drafter")
    if not d:
        return "–"
    return d.get("label", d.get("tag", "?"))


def render_speed(r: dict, docs_path: str) -> str:
    out = [f"### Decoding speed, `{r.get('mode')}` run ({r.get('date', '?')[:10]})", "", caption(r), ""]
    drafters = r.get("drafters", [])
    if any(d.get("random_init") for d in drafters):
        out.append("> **Random-init drafters:** the drafters marked UNTRAINED are randomly initialised. "
                   "They exercise the speculative machinery end to end; their speedups (below 1) and tau "
                   "(about 1) say nothing about EAGLE-3 or EAGLE 3.1.")
        out.append("")
    for n in r.get("notes", []):
        out.append(f"- {n}")
    peers = r.get("peers") or {}
    for name, st in peers.items():
        if not st.get("available"):
            out.append(f"- peer `{name}` not run: {st.get('reason')}")
    out.append(f"- total wall time of the run: {fmt(r.get('total_s'), 0)} s; target load "
               f"{fmt((r.get('target') or {}).get('load_s'), 1)} s")
    if r.get("partial"):
        out.append("- **this run did not finish**: only the workloads listed were measured")
    out.append("")
    out.append("Speedup = engine tokens/s ÷ eagle-jax plain tokens/s over the same interleaved runs "
               "(paired: median of per-run ratios, [min–max]). tok/s = all tokens ÷ summed wall time; "
               "tok/s/req = a row's tokens ÷ its batch's wall time, averaged. Greedy match = share of rows "
               "whose output equals plain decoding's. Peak RSS is the process high-water mark after the "
               "engine's runs (monotonic over the run).")
    out.append("")
    for w in r.get("workloads", []):
        out.append(f"**{w['name']}** — {w['num_prompts']} prompts ({w['num_batches']} batch(es) of "
                   f"{w['batch_size']}), prompt tokens {min(w['prompt_tokens'])}–{max(w['prompt_tokens'])}, "
                   f"T={w['temperature']:g}, {w['max_new_tokens']} new tokens, {w['rounds']} round(s)"
                   + (f", load average {w['load_average_start'][0]:.1f} at start"
                      if w.get("load_average_start") else ""))
        out.append("")
        out.append(caption(r))
        out.append("")
        rows = []
        for name, e in w["engines"].items():
            acc = e.get("acceptance") or {}
            pp = acc.get("per_position_acceptance") or []
            paired = e.get("speedup_paired_median")
            prange = (f" [{fmt(e.get('speedup_paired_min'))}–{fmt(e.get('speedup_paired_max'))}]"
                      if e.get("speedup_paired_min") is not None else "")
            mem = e.get("memory") or {}
            mem_s = fmt(mem.get("peak_rss_mb"), 0)
            if mem.get("device_peak_mb") is not None:
                mem_s += f" / dev {fmt(mem['device_peak_mb'], 0)}"
            rows.append([
                f"`{name}`", e.get("engine", ""), e.get("setting") or e.get("method", ""), _drafter_cell(e),
                fmt(e.get("tokens_per_s_total"), 1), fmt(e.get("tokens_per_s_per_request"), 1),
                fmt(e.get("speedup")), fmt(paired) + prange,
                fmt(acc.get("acceptance_length")), " ".join(f"{x:.2f}" for x in pp) or "–",
                fmt(e.get("ttft_s_median"), 3), fmt(e.get("decode_tokens_per_s"), 1), fmt(e.get("compile_s"), 1),
                fmt(e.get("greedy_match_rate")), mem_s])
        out.append(table(["engine", "kind", "setting", "drafter", "tok/s", "tok/s/req", "speedup",
                          "paired", "tau", "per-position acc.", "TTFT s", "decode tok/s", "compile s",
                          "greedy match",
                          "peak RSS MB"], rows))
        out.append("")
    peer_rows = peers_summary(r)
    if peer_rows:
        out.append("**Peers, pooled over the batch-1 greedy workloads** (same prompts, same token ids, "
                   "interleaved with eagle-jax):")
        out.append("")
        out.append(caption(r))
        out.append("")
        out.append(table(["engine", "weights / dtype", "method", "tokens", "tok/s",
                          "decode: eagle-jax plain ÷ engine", "÷ eagle-jax plain",
                          "eagle-jax plain ÷ engine", "best eagle-jax speculative ÷ engine",
                          "same tokens as eagle-jax plain", "threads (calibration tok/s)"], peer_rows))
        out.append("")
        out.append("Ratios use only the runs both engines made (same prompts, same round).")
        out.append("")
    figs = speed_figures(r)
    for title, path in figs:
        out.append(f"![{title}]({_rel(path, docs_path)})")
        out.append("")
    return "\n".join(out)


def _matched_tps(ws: list[dict], a: str, b: str, *, decode: bool = False) -> tuple[float | None, float | None]:
    """Pooled tokens/s of engines a and b over the (workload, round, batch) runs both made;
    decode: the tokens after each row's first over the time after the first token."""
    ta = wa = tb = wb = 0.0
    for w in ws:
        ea, eb = w["engines"].get(a), w["engines"].get(b)
        if not ea or not eb:
            continue
        rb = {(x["round"], x["batch"]): x for x in eb.get("runs", [])}
        for x in ea.get("runs", []):
            y = rb.get((x["round"], x["batch"]))
            if y is None or (decode and (x.get("ttft_s") is None or y.get("ttft_s") is None)):
                continue
            ta += sum(x["tokens"]) - (len(x["tokens"]) if decode else 0)
            wa += x["wall_s"] - (x["ttft_s"] if decode else 0.0)
            tb += sum(y["tokens"]) - (len(y["tokens"]) if decode else 0)
            wb += y["wall_s"] - (y["ttft_s"] if decode else 0.0)
    return (ta / wa if wa > 0 else None), (tb / wb if wb > 0 else None)


def _calib(c: dict) -> str:
    parts = [f"{k}: {v:.1f}" for k, v in c.items() if isinstance(v, (int, float))]
    if c.get("inherited_from"):
        parts.append(f"from {c['inherited_from']}")
    return ", ".join(parts)


def peers_summary(r: dict) -> list[list]:
    """Pooled tokens/s of every engine over the workloads where peers ran, with matched ratios."""
    ws = [w for w in r.get("workloads", [])
          if any(e.get("engine") != "eagle-jax" for e in w["engines"].values())]
    if not ws:
        return []
    info: dict = {}
    for w in ws:
        for name, e in w["engines"].items():
            t, s, _ = info.get(name, (0, 0.0, e))
            info[name] = (t + e.get("tokens", 0), s + e.get("wall_s", 0.0), e)
    spec = [n for n, (_, _, e) in info.items() if e.get("engine") == "eagle-jax" and n != "plain"]
    rows = []
    for n, (t, s, e) in info.items():
        v = t / s if s else None
        x, plain = _matched_tps(ws, n, "plain")
        dx, dplain = _matched_tps(ws, n, "plain", decode=True)
        best_cell = "–"
        if spec and n not in spec and n != "plain":
            best = max(spec, key=lambda m: _matched_tps(ws, m, n)[0] or 0.0)
            bx, by = _matched_tps(ws, best, n)
            if bx and by:
                best_cell = f"{fmt(bx / by)} (`{best}`)"
        rows.append([f"`{n}`", f"{e.get('weights') or ''} {e.get('dtype') or ''}".strip(),
                     e.get("setting") or e.get("method", ""), t, fmt(v, 1),
                     fmt(dplain / dx if dx and dplain else None),
                     fmt(x / plain if x and plain else None), fmt(plain / x if x and plain else None),
                     best_cell, fmt(e.get("greedy_match_rate")),
                     f"{e.get('threads') or 'XLA default'}"
                     + (f" ({_calib(e['thread_calibration'])})" if e.get("thread_calibration") else "")])
    return rows


def _line_chart(r: dict, what: str, series: dict, *, xlabel: str, ylabel: str, title: str,
                logx: bool = False, xticks=None, ylim=None, hline=None) -> str:
    """One-axis line chart of `series` {label: [(x, y), ...]} saved as this result's `what` PNG."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, pts in sorted(series.items()):
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if hline is not None:
        ax.axhline(hline, color="gray", lw=0.8, ls="--")
    if logx:
        ax.set_xscale("log", base=2)
    if xticks is not None:
        ax.set_xticks(xticks, [str(x) for x in xticks])
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(fig, r, what)


def _save(fig, r: dict, what: str) -> str:
    path = _png(r, what)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    _plt().close(fig)
    return path


def save_png(fig, path, *, dpi: int, colors: int = 64) -> None:
    """Write `fig` to `path` as a palette PNG of at most `colors` colours, atomically.

    Plots are flat colours: a 64-colour palette looks the same and takes about a
    fifth of the bytes of matplotlib's RGBA file, which matters for PNGs kept in git."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    tmp = f"{path}.tmp.png"
    Image.open(buf).convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(
        tmp, optimize=True)
    os.replace(tmp, path)


def speed_figures(r: dict) -> list[tuple[str, str]]:
    figs = []
    ws = [w for w in r.get("workloads", []) if not w["name"].startswith("peers/") and w["dataset"] != "long"]
    # speedup by batch size, per engine and temperature (mean over datasets)
    series: dict = {}
    for w in ws:
        for name, e in w["engines"].items():
            if name == w["baseline"] or e.get("speedup") is None or e.get("engine") != "eagle-jax":
                continue
            series.setdefault((name, w["temperature"]), {}).setdefault(w["batch_size"], []).append(e["speedup"])
    if series:
        all_b = sorted({b for by_b in series.values() for b in by_b})
        lines = {f"{name} T={temp:g}": [(b, sum(v) / len(v)) for b, v in by_b.items()]
                 for (name, temp), by_b in series.items()}
        figs.append(("speedup by batch size", _line_chart(
            r, "speedup", lines, xlabel="batch size", ylabel="speedup vs eagle-jax plain",
            title="Speedup by batch size (mean over datasets)", logx=True, xticks=all_b, hline=1.0)))
    # per-position acceptance (greedy, batch 1, per engine, pooled over short datasets)
    pp: dict = {}
    for w in ws:
        if w["temperature"] != 0:
            continue
        for name, e in w["engines"].items():
            acc = e.get("acceptance") or {}
            if acc.get("per_position_acceptance"):
                pp.setdefault(name, []).append(acc)
    if pp:
        lines = {}
        for name, accs in pp.items():
            steps = sum(a["num_verify_steps"] for a in accs)
            depth = min(len(a["per_position_acceptance"]) for a in accs)
            lines[name] = [(i + 1, sum(a["per_position_acceptance"][i] * a["num_verify_steps"] for a in accs)
                            / max(steps, 1)) for i in range(depth)]
        longest = max(len(v) for v in lines.values())
        figs.append(("per-position acceptance", _line_chart(
            r, "acceptance", lines, xlabel="draft position", ylabel="acceptance rate",
            title="Per-position acceptance (greedy, short prompts)", xticks=list(range(1, longest + 1)),
            ylim=(0, 1))))
    # tau by context length
    longs = [w for w in r.get("workloads", []) if w["dataset"] == "long"]
    tau: dict = {}
    for w in longs:
        for name, e in w["engines"].items():
            acc = e.get("acceptance") or {}
            if acc.get("acceptance_length") is not None:
                tau.setdefault(name, []).append((w.get("context_tokens"), acc["acceptance_length"]))
    if tau:
        figs.append(("tau by context length", _line_chart(
            r, "tau-context", tau, xlabel="context tokens", ylabel="tau (mean acceptance length)",
            title="tau by context length (greedy, batch 1)", logx=True)))
    return figs


# ----------------------------------------------------------------------------- drift


def render_drift(r: dict, docs_path: str) -> str:
    out = [f"### Attention-drift diagnostics, `{r.get('mode')}` run ({r.get('date', '?')[:10]})", "", caption(r), ""]
    if any(d.get("random_init") for d in r.get("drafters", [])):
        out.append("> **Random-init drafters** (UNTRAINED) are shown to prove the diagnostic runs; their "
                   "numbers describe random weights, not EAGLE-3 or EAGLE 3.1.")
        out.append("")
    for n in r.get("notes", []):
        out.append(f"- {n}")
    s = r.get("settings", {})
    out.append(f"- chain depth {s.get('depth')}; sink = first {s.get('sink_tokens')} positions; prompt "
               f"queries from position {s.get('prompt_query_min_pos')} on; tau from a {s.get('max_new_tokens')}"
               f"-token greedy chain generation")
    out.append("")
    rows = []
    for g in r.get("summary", []):
        rows.append([g["label"], g["context"], fmt(g["prompt_tokens_mean"], 0), g["num_prompts"],
                     fmt(g["tau"]), " ".join(f"{x:.2f}" for x in g["per_position_acceptance"]) or "–",
                     fmt(g["feature_rms_prompt"]),
                     " ".join(f"{x:.2f}" for x in g["hidden_rms_by_depth"]),
                     fmt(g["sink_mass_prompt"], 3),
                     " ".join(f"{x:.3f}" for x in g["sink_mass_by_depth"]),
                     fmt(g["root_accepted_mean"])])
    if rows:
        out.append(caption(r))
        out.append("")
        out.append(table(["drafter", "context", "prompt tok", "n", "tau", "per-position acc.",
                          "feature RMS (prompt)", "hidden RMS by depth", "sink share (prompt)",
                          "sink share by depth", "chain accepted at root"], rows))
        out.append("")
    for title, path in drift_figures(r):
        out.append(f"![{title}]({_rel(path, docs_path)})")
        out.append("")
    return "\n".join(out)


def drift_figures(r: dict) -> list[tuple[str, str]]:
    summary = r.get("summary") or []
    if not summary:
        return []
    plt = _plt()
    figs = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for g in summary:
        lab = f"{g['drafter']} ({g['context']})"
        d = range(1, len(g["hidden_rms_by_depth"]) + 1)
        axes[0].plot(d, g["hidden_rms_by_depth"], marker="o", label=lab)
        axes[1].plot(d, g["sink_mass_by_depth"], marker="o", label=lab)
    depth = max((len(g["hidden_rms_by_depth"]) for g in summary), default=1)
    for ax in axes:
        ax.set_xticks(range(1, depth + 1))
    axes[0].set_xlabel("chain depth")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("RMS of hidden input (log)")
    axes[0].set_title("Hidden-state norm by depth")
    axes[1].set_xlabel("chain depth")
    axes[1].set_ylabel("attention share on first 4 tokens")
    axes[1].set_title("Sink attention by depth")
    axes[0].legend(fontsize=6)
    figs.append(("hidden-state norm and sink attention by depth", _save(fig, r, "hidden-norm")))
    by_drafter: dict = {}
    for g in summary:
        if g["context"] != "short" and g["tau"] is not None:
            by_drafter.setdefault(g["drafter"], []).append((g["prompt_tokens_mean"], g["tau"]))
    shorts = {g["drafter"]: (g["prompt_tokens_mean"], g["tau"]) for g in summary
              if g["context"] == "short" and g["tau"] is not None}
    if by_drafter or shorts:
        lines = {dr: by_drafter.get(dr, []) + ([shorts[dr]] if dr in shorts else [])
                 for dr in set(by_drafter) | set(shorts)}
        figs.append(("tau by context length", _line_chart(
            r, "drift-tau", lines, xlabel="prompt tokens", ylabel="tau",
            title="tau by context length (chain, greedy)", logx=True)))
    return figs


# ----------------------------------------------------------------------------- serve


def render_serve(r: dict, docs_path: str) -> str:
    if r.get("mode") != "concurrency":
        return _render_serve_static_batches(r)
    st = r.get("settings", {})
    out = [f"### Per-user throughput at concurrency {', '.join(map(str, st.get('concurrency', [])))} "
           f"({r.get('date', '?')[:10]})", "", caption(r), "",
           f"`eagle-jax serve`'s slot engine in-process ({st.get('slots')} slots, max_len {st.get('max_len')}, "
           f"prompts prefilled {st.get('prefill_chunk', 'whole')} tokens a call, at most "
           f"{st.get('prefill_budget') or 'every waiting prompt'} tokens between two steps), "
           f"plain against EAGLE ({st.get('draft')}, at every batch size, each step at the draft depth its "
           f"policy picks: `eagle_drafts` {st.get('eagle_drafts', 'every step')}); at concurrency c, c greedy "
           f"chat requests (HumanEval) sent at once, {st.get('max_new_tokens')} new tokens each; a user's "
           f"throughput is its tokens over its request's wall time; {st.get('rounds')} timed rounds alternating "
           f"the servers. TTFT and ITL (gaps between streamed chunks) are p50 / p99 over the timed rounds. "
           f"Warm-up: " + ", ".join(f"{k} {fmt(v, 1)} s" for k, v in r.get("warmup_s", {}).items()) + ".", "",
           "| concurrency | per-user tok/s, plain / EAGLE | EAGLE / plain (paired median) | total tok/s, plain / EAGLE | "
           "TTFT s, plain | TTFT s, EAGLE | ITL ms, plain | ITL ms, EAGLE | same texts | EAGLE steps by draft depth |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    pair = lambda d, k=1.0, nd=2: (f"{fmt(d['p50'] * k, nd)} / {fmt(d['p99'] * k, nd)}" if d else "–")
    for c, e in r.get("levels", {}).items():
        tps, tot = e["per_user_tokens_per_s"], e.get("total_tokens_per_s", {})
        ttft, itl = e.get("ttft_s", {}), e.get("itl_s", {})
        out.append(f"| {c} | {fmt(tps['plain'], 1)} / {fmt(tps['eagle'], 1)} | {fmt(e['speedup_paired_median'])} | "
                   f"{fmt(tot.get('plain'), 1)} / {fmt(tot.get('eagle'), 1)} | {pair(ttft.get('plain'))} | "
                   f"{pair(ttft.get('eagle'))} | {pair(itl.get('plain'), 1e3, 0)} | {pair(itl.get('eagle'), 1e3, 0)} | "
                   f"{e['same_texts']} / {e['replies']} | "
                   f"{', '.join(f'{d}: {k}' for d, k in sorted(e.get('eagle_steps_by_depth', {}).items())) or '-'} |")
    levels = {int(c): e for c, e in r.get("levels", {}).items()}
    if levels:
        series = {f"{n}, {what}": [(c, e[key][n]) for c, e in levels.items() if n in e.get(key, {})]
                  for n in ("plain", "eagle")
                  for what, key in (("per user", "per_user_tokens_per_s"), ("total", "total_tokens_per_s"))}
        png = _line_chart(r, "throughput", {k: v for k, v in series.items() if v}, xlabel="concurrent users",
                          ylabel="output tokens/s", title="Serving throughput by concurrency", logx=True,
                          xticks=sorted(levels))
        out += ["", f"![serving throughput]({_rel(png, docs_path)})"]
    return "\n".join(out)


def _render_serve_static_batches(r: dict) -> str:
    """The static batcher's result files (mode "load", before the slot engine)."""
    st = r.get("settings", {})
    out = [f"### {st.get('clients')} concurrent clients, batched vs one at a time ({r.get('date', '?')[:10]})", "",
           caption(r), "",
           f"`eagle-jax serve` in-process, {st.get('clients')} greedy chat requests (HumanEval) sent at once, "
           f"{st.get('max_new_tokens')} new tokens each, batch window {fmt(st.get('batch_window_ms'), 0)} ms, "
           f"{st.get('rounds')} timed rounds alternating the two servers after a warm-up.", "",
           "| engine | tok/s, max_batch 1 | tok/s, batched | batched / unbatched (paired median) | "
           "mean latency s, 1 / batched | batch sizes seen | same texts (rounds) | warm-up s |",
           "|---|---|---|---|---|---|---|---|"]
    for name, e in r.get("engines", {}).items():
        sizes = sorted({b for x in e.get("batched", []) for b in x["batch_sizes"]})
        out.append(f"| {name} | {fmt(e.get('tokens_per_s_unbatched'), 1)} | {fmt(e.get('tokens_per_s_batched'), 1)} | "
                   f"{fmt(e.get('speedup_paired_median'))} | {fmt(e.get('latency_mean_s_unbatched'), 1)} / "
                   f"{fmt(e.get('latency_mean_s_batched'), 1)} | {', '.join(map(str, sizes))} | "
                   f"{e.get('same_texts_rounds')} / {len(e.get('batched', []))} | {fmt(e.get('warmup_s'), 0)} |")
    return "\n".join(out)


def render_draft_policy(r: dict) -> str:
    """benchmarks/draft_policy.py: slot engines without HTTP, the draft policy against fixed depths."""
    st = r.get("settings", {})
    engines = list(next(iter(r.get("levels", {}).values()), {}))
    out = [f"### The draft policy against fixed depths ({r.get('date', '?')[:10]})", "", caption(r), "",
           f"Slot engines in one process ({st.get('slots')} slots, max_len {st.get('max_len')}), no HTTP: plain, "
           f"`adaptive` (the depth of each step picked by the policy, as `eagle-jax serve` runs) and each fixed "
           f"draft depth, drafter {st.get('draft')}; at concurrency c, c greedy HumanEval chats submitted at once, "
           f"{st.get('max_new_tokens')} new tokens each; a user's throughput is its tokens over its request's "
           f"wall time; {st.get('rounds')} timed rounds, engines in a rotated order. Cells: per-user tok/s "
           f"(ratio to plain, paired by round); steps by draft depth (0: plain) and catch-up calls below.", "",
           "| concurrency | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
    for c, level in r.get("levels", {}).items():
        out.append(f"| {c} | " + " | ".join(f"{fmt(e['per_user_tokens_per_s'], 1)} ({fmt(e['vs_plain_paired_median'])})"
                                          for e in level.values()) + " |")
        out.append("| steps | " + " | ".join(
            ", ".join(f"{d}: {k}" for d, k in e["steps_by_depth"].items()) + f"; {e['catch_ups']} catch-ups"
            for e in level.values()) + " |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- step cost


def render_step_cost(r: dict, docs_path: str) -> str:
    st = r.get("settings", {})
    bw = r.get("bandwidth_gbps")
    out = [f"### Step cost ({r.get('mode')}, {r.get('date', '?')[:10]})", "", caption(r), "",
           f"Streaming bandwidth {fmt(bw, 1)} GB/s (XLA `x + 1`, read + write). Target forward = "
           f"`Target` call + logits on the decoding parameters, {st.get('context')} committed tokens; "
           f"median of {st.get('repeats')} calls. *floor*: weight bytes / bandwidth.", ""]
    series = {}
    for dtype, d in r.get("dtypes", {}).items():
        out.append(f"**{dtype}** (impl `{d.get('impl')}`, weights {fmt(d['weight_bytes'] / 2**20, 0)} MiB, "
                   f"floor {fmt(d.get('floor_ms'), 1)} ms)")
        out.append("")
        for b, costs in d.get("forward", {}).items():
            ms = sorted(costs, key=int)
            out.append(table(["batch " + b] + [f"M={m}" for m in ms],
                             [["ms"] + [fmt(costs[m]["ms"], 1) for m in ms],
                              ["/ M=1"] + [fmt(costs[m]["vs_m1"]) for m in ms],
                              ["/ floor"] + [fmt(costs[m]["vs_floor"]) for m in ms]]))
            out.append("")
            series[f"{dtype} b={b}"] = [(int(m), costs[m]["vs_m1"]) for m in ms]
        cb = d.get("compute")
        if cb:
            out.append(f"Compute: {fmt(cb['ms_per_row'], 2)} ms per row (M={cb['from_m'][0]} to "
                       f"{cb['from_m'][1]}); with M=1 at the bandwidth floor, M rows would cost at least "
                       + ", ".join(f"{fmt(v)}x (M={m})" for m, v in cb["vs_m1_at_floor"].items()) + " the M=1 cost.")
            out.append("")
        lc = d.get("long_context") or {}
        out.append(f"Plain forward (M=1) at {lc.get('context')} context: {fmt(lc.get('ms'), 1)} ms, "
                   f"{fmt(lc.get('vs_short'))}x the {st.get('context')}-token one.")
        dr = d.get("drafter") or {}
        out.append("Drafter: " + ", ".join(f"{k} {fmt(v, 2)} ms ({fmt(dr['vs_target_m1'][k])}x a target M=1 step)"
                                           for k, v in dr.items() if k not in ("weight_bytes", "vs_target_m1"))
                   + f"; weights {fmt(dr.get('weight_bytes', 0) / 2**20, 1)} MiB.")
        out.append("")
        rows = []
        for name, s in d.get("steps", {}).items():
            bd = (d.get("breakdown") or {}).get(name, {})
            rows.append([name, fmt(s["ms_per_step"], 1), fmt(s["vs_plain_step"]), fmt(s.get("tau")),
                         fmt(s["tokens_per_s"], 1), fmt(s["speedup"]), fmt(s.get("greedy_match")),
                         ", ".join(f"{k} {fmt(v, 1)}" for k, v in bd.items())])
        out.append(table(["engine", "ms / step", "/ plain step", "tau", "tok/s", "speedup", "greedy match",
                          "trace: XLA op ms per step by scope"], rows))
        bt = d.get("batched")
        if bt:
            out.append("")
            out.append(f"Batched plain decoding: 16 rows {fmt(bt['rows_16_tok_s'], 0)} tok/s, 1 row "
                       f"{fmt(bt['rows_1_tok_s'], 0)} tok/s ({fmt(bt['ratio'], 1)}x).")
        out.append("")
    if series:
        png = _line_chart(r, "forward-cost", series, xlabel="new tokens per row (M)", ylabel="cost / cost at M=1",
                          title="Target forward cost against M", logx=True,
                          xticks=sorted({m for v in series.values() for m, _ in v}), hline=1.0)
        out.append(f"![forward cost against M]({_rel(png, docs_path)})")
    return "\n".join(out)


# ----------------------------------------------------------------------------- learning curve


def render_learning_curve(points: list[dict], png_path: str, docs_path: str) -> str:
    """Table of every learning-curve point and a plot against token positions seen."""
    from eagle_jax.benchmarks.learning_curve import ENGINES, PROMPT_SETS

    first = points[0]
    st = first["setting"]
    out = [f"Every training run adds a point (`eagle-jax train ... --learning-curve`, or `eagle-jax bench --suite "
           f"learning-curve --draft DIR`). Fixed held-out sets (`benchmarks/prompts/"
           f"{first['heldout_set']['file']}`, sha1 {first['heldout_set']['sha1']}): teacher-forced top-1 per TTT "
           f"step (strict: a target token outside the draft vocabulary is a miss) over "
           f"{len(first['heldout_set']['answers'])} held-out ShareGPT answers of the target; engine tau at "
           f"{st['dtype']}, greedy, batch {st['batch_size']}, {st['max_new_tokens']} new tokens on "
           + " + ".join(f"{len(first['heldout_set'][n])} {n}" for n in PROMPT_SETS) + " prompts.", ""]
    rows = []
    for p in points:
        tr = p["training"]
        rows.append([p["date"][:10], p["label"], p["variant"], fmt(tr["token_positions"]), fmt(tr.get("steps")),
                     " / ".join(f"{x:.3f}" for x in p["teacher_forced"]["strict"]),
                     *[" / ".join(fmt(p["tau"][e][n]["tau"]) for n in (*PROMPT_SETS, "all"))
                       if e in p["tau"] else fmt(None) for e in ENGINES],
                     p["machine"]])
    out.append(table(["date", "label", "variant", "token positions", "steps", "teacher-forced strict per TTT step",
                      *[f"tau {e} ({' / '.join((*PROMPT_SETS, 'all'))})" for e in ENGINES], "machine"], rows))
    out.append("")
    out.append("Token positions: batch rows x padded length summed over training steps; where each figure comes "
               "from is in the point's `training.token_positions_source`.")
    out.append("")
    out.append(f"![learning curve]({_rel(learning_curve_figure(points, png_path), docs_path)})")
    return "\n".join(out)


def learning_curve_figure(points: list[dict], png_path: str) -> str:
    """Teacher-forced step-0 accuracy and pooled tau against token positions, one line per variant."""
    from eagle_jax.benchmarks.learning_curve import ENGINES

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for variant in sorted({p["variant"] for p in points}):
        pts = sorted((p["training"]["token_positions"], p) for p in points
                     if p["variant"] == variant and p["training"]["token_positions"] is not None)
        xs = [x for x, _ in pts]
        axes[0].plot(xs, [p["teacher_forced"]["strict"][0] for _, p in pts], marker="o", label=variant)
        for e in ENGINES:
            measured = [(x, p["tau"][e]["all"]["tau"]) for x, p in pts if e in p["tau"]]
            if measured:
                axes[1].plot(*zip(*measured), marker="o", label=f"{variant} {e}")
    for ax, ylabel, title in ((axes[0], "top-1 accuracy, TTT step 0", "Teacher-forced accuracy (held-out answers)"),
                              (axes[1], "tau (all prompts)", "Engine tau (fp32, greedy)")):
        ax.set_xscale("log")
        ax.set_xlabel("token positions seen")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, png_path, dpi=110)
    plt.close(fig)
    return png_path


# ----------------------------------------------------------------------------- document


INTRO = """# Benchmarks

This file is generated by `eagle-jax bench --suite report` (benchmarks/report.py)
from the JSON results in `benchmarks/results/`; edit `benchmarks/results/analysis.md`
for commentary, not this file. Every table names the command, the machine and
the date of the run that produced it. Numbers are reported as measured,
including those that fall short of their targets.

Reproduce:

```
python benchmarks/plain_vs_transformers.py          # plain decoding vs transformers (foundation check)
eagle-jax bench --quick                             # < 10 min on a 2-core CPU
eagle-jax bench                                     # full grid (batch 1/4/16, T 0 and 0.7, long context)
eagle-jax bench --suite drift [--quick]             # attention-drift diagnostics
eagle-jax bench --suite serve                       # the HTTP server under concurrent load
eagle-jax bench --suite draft-policy                # slot engines without HTTP: the policy against fixed depths
eagle-jax bench --suite step-cost [--quick]         # forward cost against M, step breakdown
eagle-jax bench --suite learning-curve --draft DIR  # one learning-curve point (a drafter or train/state/<v>)
eagle-jax bench --suite report                      # re-render this file
```

Method (benchmarks/harness.py): every speedup is measured against plain
decoding by the same engine (eagle-jax, same weights, same compiled runtime)
in the same process, with the engines interleaved run by run (A, B, A, B, ...;
odd rounds reversed) after a warm-up whose compile time is reported
separately (`compile s`). Prompt sets (benchmarks/datasets.py): HumanEval
(164 problems, chat request to complete the function), the first user turn
of held-out ShareGPT conversations (train/data.py split), and real Python
modules of installed packages cut to about 1k/2k/4k/7k chat tokens followed
by a question about them. Peers (benchmarks/peers.py) decode the same token
ids greedily at batch 1.
"""


def _brief(r: dict) -> str:
    """A one-line gist of an older result (so superseded numbers keep their context)."""
    if r["suite"] == "plain_vs_transformers" and r.get("ratio_paired_median") is not None:
        threads = r.get("transformers_threads") or "torch default"
        return (f" — ratio {r['ratio_paired_median']:.2f} (eagle-jax {fmt(r.get('eagle_jax_tokens_per_s'), 1)} vs "
                f"transformers {fmt(r.get('transformers_tokens_per_s'), 1)} tok/s, transformers threads: {threads})")
    if r["suite"] == "speed":
        peers = r.get("workloads") and any(e.get("thread_calibration") for w in r["workloads"]
                                           for e in w["engines"].values())
        return (f" — {len(r.get('workloads', []))} workloads in {fmt(r.get('total_s'), 0)} s"
                + ("" if peers else "; peers at their default thread count"))
    return ""


def render(results_dir: str | None = None, docs_path: str | None = None) -> str:
    results_dir = results_dir or RESULTS_DIR
    docs_path = docs_path or DEFAULT_DOCS
    results = load_results(results_dir)
    chosen, rest = newest(results)
    parts = [INTRO]
    analysis = os.path.join(results_dir, ANALYSIS_FILE)
    if os.path.isfile(analysis):
        with open(analysis) as f:
            parts.append("## Analysis\n\n" + f.read().strip() + "\n")
    sections = [("plain_vs_transformers", "## Plain decoding vs transformers", render_plain_vs_transformers),
                ("speed", "## Decoding speed", lambda r: render_speed(r, docs_path)),
                ("drift", "## Attention drift", lambda r: render_drift(r, docs_path)),
                ("serve", "## Serving under concurrent load", lambda r: render_serve(r, docs_path)),
                ("draft_policy", "## The slot engine's draft policy", render_draft_policy),
                ("step_cost", "## Step cost", lambda r: render_step_cost(r, docs_path))]
    for suite, title, fn in sections:
        rs = [r for r in chosen if r["suite"] == suite]
        parts.append(title + "\n")
        if not rs:
            parts.append("No results yet.\n")
        for r in rs:
            parts.append(fn(r) + "\n")
    from eagle_jax.benchmarks.learning_curve import read_curve

    points = read_curve(os.path.join(results_dir, "learning_curve.jsonl"))
    parts.append("## Learning curve\n")
    parts.append(render_learning_curve(points, os.path.join(results_dir, "learning_curve.png"), docs_path) + "\n"
                 if points else "No points yet.\n")
    if rest:
        parts.append("## Older result files\n")
        for r in sorted(rest, key=lambda r: r["_path"]):
            parts.append(f"- `{os.path.basename(r['_path'])}` — {r['suite']} {r.get('mode') or ''} — "
                         f"{r.get('date', '?')} — `{r.get('command', '?')}`{_brief(r)}")
        parts.append("")
    text = "\n".join(parts).rstrip() + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(docs_path)), exist_ok=True)
    with open(docs_path, "w") as f:
        f.write(text)
    return docs_path


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--results-dir", default=None)
    ap.add_argument("--docs", default=None)
    a = ap.parse_args()
    print(render(a.results_dir, a.docs))
    sys.exit(0)
