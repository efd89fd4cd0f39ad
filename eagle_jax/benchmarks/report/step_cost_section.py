"""The step_cost suite's section: target forward cost against M, drafter cost and the step breakdown.
"""

from __future__ import annotations

from eagle_jax.benchmarks.report.common import _line_chart, _rel, caption, fmt, table


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
