"""The speed suite's section: per-workload engine tables, the pooled peers table and the speed figures.
"""

from __future__ import annotations

from eagle_jax.benchmarks.report.common import _line_chart, _rel, caption, fmt, table


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


# ----------------------------------------------------------------------------- peers


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


# ----------------------------------------------------------------------------- figures


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
