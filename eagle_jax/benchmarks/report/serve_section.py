"""The serve suite's section: the HTTP server under concurrent load (and the older static-batch runs).
"""

from __future__ import annotations

from eagle_jax.benchmarks.report.common import _line_chart, _rel, caption, fmt


def render_serve(r: dict, docs_path: str) -> str:
    if r.get("mode") != "concurrency":
        return _render_serve_static_batches(r)
    st = r.get("settings", {})
    out = [f"### Per-user throughput at concurrency {', '.join(map(str, st.get('concurrency', [])))} "
           f"({r.get('date', '?')[:10]})", "", caption(r), "",
           f"`eagle-jax serve`'s engine in-process ({st.get('slots')} rows, max_len {st.get('max_len')}, "
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
    """The static batcher's result files (mode "load", before the engine)."""
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
