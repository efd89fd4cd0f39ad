"""Report rendering (benchmarks/report/) from synthetic result JSONs; no timing."""

from __future__ import annotations

import gzip
import json
import os

import pytest

pytest.importorskip("matplotlib")

from eagle_jax.benchmarks import report  # noqa: E402

MACHINE = {"hostname": "h", "cpu_model": "Test CPU", "cpu_count": 2, "cpu_affinity": 2, "memory_gb": 8.0,
           "backend": "cpu", "devices": ["cpu"], "device_count": 1, "description": "Test CPU, 2 cores"}


def _engine(name, tps, speedup, tau=None, pp=None, drafter=None, engine="eagle-jax"):
    acc = None
    if tau is not None:
        acc = {"num_verify_steps": 10, "accepted_tokens": int((tau - 1) * 10), "acceptance_length": tau,
               "draft_acceptance_rate": 0.3, "per_position_acceptance": pp, "accepted_histogram": [1, 2, 3]}
    return {"engine": engine, "method": "plain" if drafter is None else "chain", "setting": None if drafter is None else "k=2",
            "drafter": drafter, "tokens_per_s_total": tps, "tokens_per_s_per_request": tps,
            "speedup": speedup, "speedup_paired_median": speedup, "speedup_paired_min": speedup,
            "speedup_paired_max": speedup, "ttft_s_median": 0.1, "acceptance": acc, "compile_s": 3.0,
            "greedy_match_rate": None if drafter is None else 1.0, "memory": {"peak_rss_mb": 900.0}, "runs": []}


def _workload(name, dataset, b, temp=0.0, ctx=None):
    d = {"tag": "random-eagle3.1", "label": "random-init EAGLE 3.1 (UNTRAINED)", "random_init": True}
    return {"name": name, "dataset": dataset, "batch_size": b, "temperature": temp, "max_new_tokens": 64,
            "context_tokens": ctx, "rounds": 1, "num_prompts": b, "num_batches": 1, "prompt_ids": ["a"] * b,
            "prompt_tokens": [100] * b, "shape": None, "baseline": "plain",
            "engines": {"plain": _engine("plain", 10.0, 1.0),
                        "chain-k2/random-eagle3.1": _engine("c", 5.0, 0.5, 1.2, [0.15, 0.05], d)},
            "skipped_engines": []}


def _write(path, obj):
    with (gzip.open(path, "wt") if str(path).endswith(".gz") else open(path, "w")) as f:
        json.dump(obj, f)


@pytest.fixture
def results(tmp_path):
    rd = tmp_path / "results"
    rd.mkdir()
    head = {"machine": MACHINE, "jax_version": "0.0", "command": "eagle-jax bench --quick"}
    _write(rd / "speed-quick-1.json", {**head, "suite": "speed", "mode": "quick", "date": "2026-01-01T00:00:00",
                                       "drafters": [{"tag": "random-eagle3.1", "random_init": True}],
                                       "notes": ["no trained drafter found"], "total_s": 100.0,
                                       "peers": {"llama.cpp": {"available": False, "reason": "ImportError: x"}},
                                       "workloads": [_workload("humaneval/b1/T0", "humaneval", 1),
                                                     _workload("humaneval/b4/T0", "humaneval", 4),
                                                     _workload("long/1024/b1/T0", "long", 1, ctx=1024)]})
    _write(rd / "speed-quick-0.json", {**head, "suite": "speed", "mode": "quick", "date": "2025-01-01T00:00:00",
                                       "workloads": []})
    # older results are committed gzipped
    _write(rd / "drift-quick-1.json.gz", {**head, "suite": "drift", "mode": "quick", "date": "2026-01-01T00:00:00",
                                       "settings": {"depth": 3, "sink_tokens": 4, "prompt_query_min_pos": 16,
                                                    "max_new_tokens": 64},
                                       "drafters": [{"random_init": True}], "notes": [],
                                       "summary": [{"drafter": "d", "label": "D", "variant": "EAGLE-3",
                                                    "random_init": True, "context": c, "num_prompts": 1,
                                                    "prompt_tokens_mean": n, "tau": 1.1,
                                                    "per_position_acceptance": [0.1, 0.0, 0.0],
                                                    "hidden_rms_by_depth": [1.0, 2.0, 3.0],
                                                    "feedback_out_rms_by_depth": [2.0, 3.0, 4.0],
                                                    "sink_mass_by_depth": [0.1, 0.2, 0.3],
                                                    "feature_rms_prompt": 1.0, "sink_mass_prompt": 0.05,
                                                    "root_accepted_mean": 0.0}
                                                   for c, n in (("short", 150.0), (1024, 1020.0))]})
    _write(rd / "plain_vs_transformers-1.json", {
        **head, "suite": "plain_vs_transformers", "date": "2026-01-01T00:00:00",
        "command": "python benchmarks/plain_vs_transformers.py",
        "settings": {"max_new_tokens": 128, "prompt_tokens": 60}, "rounds": [{}, {}, {}],
        "eagle_jax_tokens_per_s": 20.0, "transformers_tokens_per_s": 12.0, "ratio_paired_median": 1.66,
        "ratio_of_medians": 1.67, "target_ratio": 1.5, "ratio_target_met": True,
        "eagle_jax_compile_s": 8.0, "eagle_jax_second_call_s": 6.0, "warm_start_s": 12.0,
        "warm_start_target_s": 10.0, "warm_start_target_met": False,
        "warm_start_breakdown": {"import_jax_s": 1.0, "load_target_s": 6.0, "process_wall_s": 12.0},
        "profile": {"step_ms_median": 40.0, "weight_bytes": 5e8, "kv_cache_bytes_read": 1e6}})
    burst = lambda tps, sizes: {"wall_s": 1.0, "tokens": 64, "tokens_per_s": tps, "latency_mean_s": 2.0,
                                "latency_max_s": 3.0, "batch_sizes": sizes}
    _write(rd / "serve-load-1.json", {
        **head, "suite": "serve", "mode": "load", "date": "2026-01-01T00:00:00",
        "command": "eagle-jax bench --suite serve",
        "settings": {"clients": 8, "max_new_tokens": 64, "rounds": 1, "batch_window_ms": 20.0},
        "engines": {"plain": {"warmup_s": 30.0, "unbatched": [burst(20.0, [1])], "batched": [burst(61.0, [8])],
                              "tokens_per_s_unbatched": 20.0, "tokens_per_s_batched": 61.0,
                              "latency_mean_s_unbatched": 9.5, "latency_mean_s_batched": 4.2,
                              "speedup_paired_median": 3.05, "same_texts_rounds": 1}}})
    pct = lambda p50, p99: {"p50": p50, "p99": p99}
    level = lambda p, e: {"per_user_tokens_per_s": {"plain": p, "eagle": e}, "speedup_paired_median": e / p,
                          "total_tokens_per_s": {"plain": 2 * p, "eagle": 2 * e},
                          "latency_mean_s": {"plain": 3.0, "eagle": 2.5}, "same_texts": 4, "replies": 4,
                          "ttft_s": {"plain": pct(0.5, 0.9), "eagle": pct(0.6, 1.0)},
                          "itl_s": {"plain": pct(0.02, 0.2), "eagle": pct(0.025, 0.3)},
                          "eagle_steps_by_depth": {"0": 3, "1": 7}}
    _write(rd / "serve-concurrency-1.json", {
        **head, "suite": "serve", "mode": "concurrency", "date": "2026-01-02T00:00:00",
        "command": "eagle-jax bench --suite serve",
        "settings": {"concurrency": [1, 4], "max_new_tokens": 64, "rounds": 1, "slots": 4, "max_len": 512,
                     "draft": "default", "engine": "slots"},
        "warmup_s": {"plain": 20.0, "eagle": 26.0}, "levels": {"1": level(40.0, 52.0), "4": level(25.0, 21.5)}})
    (rd / "analysis.md").write_text("Hand-written findings.\n")
    (rd / "not-a-result.json").write_text("[1, 2]")
    return rd


def test_render_writes_tables_captions_and_figures(results, tmp_path):
    docs = tmp_path / "docs" / "benchmarks.md"
    out = report.render(results_dir=str(results), docs_path=str(docs))
    text = open(out).read()
    assert "Hand-written findings." in text
    assert "*Command:* `eagle-jax bench --quick`" in text and "Test CPU, 2 cores" in text
    assert "**not met**" in text  # the warm start above target is shown as such
    assert "1.66" in text and "Random-init drafters" in text
    assert "peer `llama.cpp` not run: ImportError: x" in text
    assert "| `chain-k2/random-eagle3.1` |" in text
    assert "speed-quick-0.json" in text  # the older file is listed, not rendered
    assert "| plain | 20.0 | 61.0 | 3.05 | 9.5 / 4.2 | 8 | 1 / 1 | 30 |" in text
    # the engine's concurrency table: per-user and total tok/s, TTFT s and ITL ms p50 / p99
    assert ("| 1 | 40.0 / 52.0 | 1.30 | 80.0 / 104.0 | 0.50 / 0.90 | 0.60 / 1.00 | 20 / 200 | 25 / 300 | 4 / 4 | "
            "0: 3, 1: 7 |") in text
    assert "| 4 | 25.0 / 21.5 | 0.86 |" in text and "plain 20.0 s, eagle 26.0 s" in text
    assert "serve-concurrency-1-throughput.png" in os.listdir(results)
    # every table is preceded (within a few lines) by a caption naming command, machine, date
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|---"):
            window = "\n".join(lines[max(0, i - 8):i])
            assert "*Command:*" in window and "*date:*" in window, lines[i - 1]
    pngs = [p for p in os.listdir(results) if p.endswith(".png")]
    assert {"speed-quick-1-speedup.png", "speed-quick-1-acceptance.png", "speed-quick-1-tau-context.png",
            "drift-quick-1-hidden-norm.png", "drift-quick-1-drift-tau.png"} <= set(pngs)  # named by the stem
    for p in pngs:
        if p.startswith(("speed-quick-1", "drift-quick-1")):
            assert f"../results/{p}" in text


def test_render_with_no_results(tmp_path):
    docs = tmp_path / "benchmarks.md"
    report.render(results_dir=str(tmp_path), docs_path=str(docs))
    assert "No results yet." in docs.read_text()


def test_step_cost_section(tmp_path):
    from eagle_jax.benchmarks import step_cost

    rd = tmp_path / "results"
    rd.mkdir()
    fwd = {str(m): {"ms": 10.0 + m, "vs_m1": (10.0 + m) / 11.0, "vs_floor": (10.0 + m) / 7.0} for m in (1, 5, 16)}
    step = lambda ms, ratio, tau, speed: {"ms_per_step": ms, "vs_plain_step": ratio, "tau": tau, "tokens_per_s": 90.0,
                                          "speedup": speed, "greedy_match": True}
    _write(rd / "step_cost-quick-1.json", {
        "machine": MACHINE, "jax_version": "0.0", "command": "eagle-jax bench --suite step-cost --quick",
        "suite": "step_cost", "mode": "quick", "date": "2026-01-01T00:00:00", "bandwidth_gbps": 40.0,
        "settings": {"context": 256, "repeats": 9},
        "dtypes": {"bfloat16": {"impl": "native", "weight_bytes": 270 * 2**20, "floor_ms": 7.0,
                                "forward": {"1": fwd}, "compute": step_cost.compute_bound(fwd, 7.0),
                                "long_context": {"context": 4096, "ms": 14.0, "vs_short": 1.27},
                                "drafter": {"step_T1": 0.5, "weight_bytes": 2**20, "vs_target_m1": {"step_T1": 0.05}},
                                "steps": {"plain": step(11.0, 1.0, None, 1.0), "tree": step(17.0, 1.55, 1.8, 1.16)},
                                "breakdown": {"tree": {"target": 14.0, "draft": 1.0}},
                                "batched": {"rows_1_tok_s": 90.0, "rows_16_tok_s": 800.0, "ratio": 8.9}}}})
    docs = tmp_path / "benchmarks.md"
    text = open(report.render(results_dir=str(rd), docs_path=str(docs))).read()
    section = text.split("## Step cost", 1)[1]
    assert "eagle-jax bench --suite step-cost --quick" in section
    assert "| / M=1 | 1.00 | 1.36 | 2.36 |" in section
    assert "| tree | 17.0 | 1.55 | 1.80 | 90.0 | 1.16 | yes | target 14.0, draft 1.0 |" in section
    assert "(8.9x)" in section and "forward-cost.png" in section
    # one row costs 1 ms between M=5 and M=16; from a 7 ms floor: M=8 max(7, 8)/7, M=16 16/7
    assert ("Compute: 1.00 ms per row (M=5 to 16); with M=1 at the bandwidth floor, M rows would cost at "
            "least 1.00x (M=5), 1.14x (M=8), 1.71x (M=12), 2.29x (M=16) the M=1 cost.") in section


def test_learning_curve_section(tmp_path):
    from eagle_jax.benchmarks import learning_curve as lc

    rd = tmp_path / "results"
    acc = lambda tau: {"tau": tau, "per_position": [0.2], "verify_steps": 10, "accepted": 2, "prompts": 1}
    # the first point predates chain k=5 (only the engines of ALWAYS_MEASURED)
    for positions, tau, engines in ((1000, 1.25, lc.ALWAYS_MEASURED), (3000, 1.5, tuple(lc.ENGINES))):
        lc.append_point({
            "schema": 1, "date": "2026-01-01T00:00:00", "label": f"run{positions}", "variant": "eagle3.1",
            "drafter": "d", "machine": "Test CPU", "setting": {"dtype": "float32", "batch_size": 1,
                                                                "max_new_tokens": 64,
                                                                "engines": {e: {} for e in engines}},
            "training": {"token_positions": positions, "token_positions_source": "test", "data": [],
                         "settings": {}, "steps": 3},
            "heldout_set": {"file": "h.jsonl.gz", "sha1": "abc", "answers": ["a"], "humaneval": ["h"],
                            "sharegpt": ["s"]},
            "teacher_forced": {"strict": [0.25, 0.125], "in_vocab": [0.3, 0.2]},
            "tau": {e: {n: acc(tau) for n in ("humaneval", "sharegpt", "all")} for e in engines}},
            rd / "learning_curve.jsonl")
    docs = tmp_path / "benchmarks.md"
    section = open(report.render(results_dir=str(rd), docs_path=str(docs))).read().split("## Learning curve", 1)[1]
    assert ("| 2026-01-01 | run3000 | eagle3.1 | 3000 | 3 | 0.250 / 0.125 | 1.50 / 1.50 / 1.50 | 1.50 / 1.50 / 1.50 "
            "| 1.50 / 1.50 / 1.50 |") in section
    assert ("| run1000 | eagle3.1 | 1000 | 3 | 0.250 / 0.125 | 1.25 / 1.25 / 1.25 | 1.25 / 1.25 / 1.25 | – |"
            in section)
    assert "1 humaneval + 1 sharegpt prompts" in section
    assert "(results/learning_curve.png)" in section and (rd / "learning_curve.png").is_file()


def test_decode_rates_leave_out_the_first_token_and_match_runs():
    """Decode tokens/s count the tokens after each row's first over the time after it, over
    the runs both engines made; whole-request tokens/s still include prefill."""
    from eagle_jax.benchmarks import harness
    from eagle_jax.benchmarks.report import speed_section

    def run(rnd, wall, ttft, n=65):
        return {"round": rnd, "batch": 0, "wall_s": wall, "ttft_s": ttft, "tokens": [n], "token_ids": [[1]]}

    plain = [run(0, 1.0, 0.36), run(1, 1.0, 0.36)]
    peer = [run(0, 0.9, 0.1), run(2, 5.0, 0.1)]  # round 2: plain has no such run
    w = {"engines": {"plain": {"runs": plain}, "peer": {"runs": peer}}}
    x, y = speed_section._matched_tps([w], "peer", "plain", decode=True)
    assert x == pytest.approx(64 / 0.8) and y == pytest.approx(64 / 0.64)
    x, y = speed_section._matched_tps([w], "peer", "plain")
    assert x == pytest.approx(65 / 0.9) and y == pytest.approx(65 / 1.0)
    s = harness.summarize_engine(plain, plain, greedy=True, is_baseline=True)
    assert s["decode_tokens_per_s"] == pytest.approx(128 / 1.28)


def test_draft_policy_section(tmp_path):
    rd = tmp_path / "results"
    rd.mkdir()
    cell = lambda tps, ratio, steps, catch: {"per_user_tokens_per_s": tps, "vs_plain_paired_median": ratio,
                                             "steps_by_depth": steps, "catch_ups": catch,
                                             "same_texts_as_plain": 4, "replies": 4}
    _write(rd / "draft_policy-engines-1.json", {
        "machine": MACHINE, "jax_version": "0.0", "command": "eagle-jax bench --suite draft-policy",
        "suite": "draft_policy", "mode": "engines", "date": "2026-01-01T00:00:00",
        "settings": {"slots": 4, "max_len": 512, "draft": "default", "max_new_tokens": 64, "rounds": 3},
        "levels": {"1": {"plain": cell(40.0, 1.0, {"0": 63}, 0), "adaptive": cell(44.0, 1.1, {"1": 40}, 2),
                         "depth 1": cell(43.0, 1.08, {"1": 42}, 2)}}})
    docs = tmp_path / "benchmarks.md"
    text = open(report.render(results_dir=str(rd), docs_path=str(docs))).read()
    section = text.split("## The engine's draft policy", 1)[1]
    assert "eagle-jax bench --suite draft-policy" in section
    assert "| concurrency | plain | adaptive | depth 1 |" in section
    assert "| 1 | 40.0 (1.00) | 44.0 (1.10) | 43.0 (1.08) |" in section
    assert "| steps | 0: 63; 0 catch-ups | 1: 40; 2 catch-ups | 1: 42; 2 catch-ups |" in section
