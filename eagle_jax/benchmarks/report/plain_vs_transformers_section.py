"""The plain_vs_transformers suite's section: plain greedy decoding against transformers `generate`.
"""

from __future__ import annotations

from eagle_jax.benchmarks.report.common import caption, fmt, table


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
