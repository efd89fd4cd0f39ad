"""`eagle-jax bench`: decoding-speed benchmark, drift diagnostics, report.

    eagle-jax bench --quick                         # < 10 min on a 2-core CPU
    eagle-jax bench                                 # the full grid (hours on CPU)
    eagle-jax bench --draft runs/x/export --draft runs/y/export
    eagle-jax bench --quick --random-drafter eagle3.1   # machinery check, untrained drafter
    eagle-jax bench --suite drift [--quick]
    eagle-jax bench --suite plain-vs-transformers
    eagle-jax bench --suite serve                   # HTTP server: per-user tok/s at concurrency 1/4/16, EAGLE vs plain
    eagle-jax bench --suite draft-policy            # engines, no HTTP: the draft policy against fixed depths
    eagle-jax bench --suite step-cost [--quick]     # forward cost against M, step breakdown (CPU issue)
    eagle-jax bench --suite learning-curve --draft train/state/eagle3.1 [--label NAME]
                                                    # a learning-curve point (benchmarks/learning_curve.py)
    eagle-jax bench --suite report                  # re-render docs/benchmarks.md
    eagle-jax bench --suite device [--dry-run]      # first run on a GPU/TPU (scripts/device_check.sh)

Drafters: every `--draft` (a directory or a bundled name), else the bundled
EAGLE-3 and EAGLE 3.1 drafters of the target when they are shipped. When
none exists the benchmark says so and runs plain decoding (and the peers)
only; `--random-drafter` adds randomly initialised drafters, labelled as such
everywhere, to exercise the speculative machinery (their speedups are
meaningless: they accept almost nothing).

Results: one JSON per run under benchmarks/results/ (date and machine in the
name; machine, versions, date and the exact command inside), then
docs/benchmarks.md is re-rendered from every JSON there.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from eagle_jax.cli.args import add_disable_by_batch_size
from eagle_jax.config import SpecConfig
from eagle_jax.benchmarks.drafters import resolve_drafters

_DEFAULT_TREE = f"{SpecConfig.tree_top_k}x{SpecConfig.tree_depth}x{SpecConfig.tree_total_tokens}"
# --quick measures the engine's default chain and tree settings
QUICK = dict(batch_sizes=[1, 4], temperatures=[0.0], num_prompts=2, max_new_tokens=64,
             chain_k=[SpecConfig.num_speculative_tokens], trees=[_DEFAULT_TREE], long_lengths=[1024], long_per_length=1, rounds=1,
             datasets=["humaneval", "sharegpt"], peer_batches=1, sharegpt_max_tokens=256)
FULL = dict(batch_sizes=[1, 4, 16], temperatures=[0.0, 0.7], num_prompts=8, max_new_tokens=128,
            chain_k=sorted({2, 4, 6, SpecConfig.num_speculative_tokens}),
            trees=list(dict.fromkeys([_DEFAULT_TREE, "4x4x16", "6x5x32", "10x7x60"])),
            long_lengths=[1024, 2048, 4096, 7168], long_per_length=2, rounds=2,
            datasets=["humaneval", "sharegpt"], peer_batches=None, sharegpt_max_tokens=256)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _strs(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--suite", choices=["speed", "drift", "plain-vs-transformers", "serve", "draft-policy",
                                       "step-cost", "learning-curve", "report", "device"],
                   default="speed")
    p.add_argument("--quick", action="store_true", help="small grid that fits in 10 minutes on a 2-core CPU")
    p.add_argument("--dry-run", action="store_true",
                   help="device suite: tiny shapes on CPU, Pallas interpreted (benchmarks/device_check.py)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--draft", action="append", default=[],
                   help="drafter directory or bundled name (repeatable); default: the bundled ones")
    p.add_argument("--no-bundled", action="store_true", help="ignore bundled drafters")
    p.add_argument("--random-drafter", choices=["eagle3", "eagle3.1", "both"], default=None,
                   help="add randomly initialised drafter(s), labelled as untrained (machinery check)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--batch-sizes", type=_ints, default=None, help="e.g. 1,4,16")
    p.add_argument("--temperatures", type=_floats, default=None, help="e.g. 0,0.7")
    p.add_argument("--datasets", type=_strs, default=None, help="humaneval,sharegpt")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per dataset (a batch size above it uses batch-size prompts)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--chain-k", type=_ints, default=None, help="chain lengths, e.g. 2,4,6")
    p.add_argument("--trees", type=_strs, default=None, help="tree envelopes TOPKxDEPTHxTOTAL, e.g. 4x4x16")
    p.add_argument("--long-lengths", type=_ints, default=None, help="long-context sizes (tokens); 0 = none")
    p.add_argument("--long-per-length", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None, help="interleaved timed rounds per workload")
    add_disable_by_batch_size(p)
    p.add_argument("--peers", type=_strs, default=["transformers", "transformers-pld", "llama.cpp"],
                   help="peer engines (transformers, transformers-pld, llama.cpp); 'none' for none")
    p.add_argument("--peer-threads", default="auto",
                   help="peer threads: 'auto' (calibrate 1 vs all cores, keep the faster) or a number")
    p.add_argument("--peer-batches", type=int, default=None,
                   help="peers run on the first N batch-1 prompts of each dataset (quick: 1; full: all)")
    p.add_argument("--sharegpt-max-tokens", type=int, default=None,
                   help="longest ShareGPT first turn kept, chat tokens (default 256)")
    p.add_argument("--cold-cache", action="store_true",
                   help="compile into a fresh persistent-cache directory (compile_s = real compiles)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None, help="default: benchmarks/results")
    p.add_argument("--docs", default=None, help="report path (default docs/benchmarks.md)")
    p.add_argument("--no-report", action="store_true", help="do not re-render the report afterwards")
    p.add_argument("--label", default=None,
                   help="name of a partial grid (e.g. long-context): the report keeps the newest run per label "
                        "beside the quick and full ones (default: quick or full); learning-curve: the point's name")
    # drift suite
    p.add_argument("--drift-depth", type=int, default=None, help="drift: chain depth probed")
    p.add_argument("--prompt-formats", type=_strs, default=None,
                   help="drift: formats of the short prompts, from template, system-short, system-long, "
                        "system-code, raw (default: template)")
    # serve and draft-policy suites
    p.add_argument("--serve-concurrency", default="1,4,16",
                   help="serve, draft-policy: concurrent users, comma-separated (an engine has as many rows "
                        "as the most)")
    p.add_argument("--prefill-chunk", type=int, default=64,
                   help="serve: prompt tokens the engine prefills a call")
    p.add_argument("--prefill-budget", type=int, default=256,
                   help="serve: most prompt tokens the engine prefills between two steps while rows "
                        "decode (0: every waiting prompt before the next step)")


def _settings(args) -> dict:
    base = dict(QUICK if args.quick else FULL)
    for key in base:
        v = getattr(args, key, None)
        if v is not None:
            base[key] = v
    base["long_lengths"] = [x for x in base["long_lengths"] if x > 0]
    return base


def _tree(s: str):
    k, d, n = (int(x) for x in s.lower().split("x"))
    return SpecConfig(method="tree", tree_top_k=k, tree_depth=d, tree_total_tokens=n)


# ----------------------------------------------------------------------------- speed suite


def run_speed(args, log) -> dict:
    from eagle_jax.benchmarks import datasets as ds
    from eagle_jax.benchmarks import harness as H
    from eagle_jax.convert.registry import load_target, smollm2_gguf_path
    from eagle_jax.generate import Generator
    from eagle_jax.runtime import default_dtype

    st = _settings(args)
    result = H.result_header("speed")
    result["mode"] = args.label or ("quick" if args.quick else "full")
    result["settings"] = st
    result["partial"] = True
    t_start = time.perf_counter()
    result["compile_cache"] = _compile_cache(args)
    dtype = args.dtype or default_dtype()
    t0 = time.perf_counter()
    target = load_target(args.target, dtype=dtype)
    result["target"] = {"name": args.target, "source": target.source, "dtype": dtype,
                        "load_s": time.perf_counter() - t0}
    log(f"target {args.target} ({dtype}) loaded in {result['target']['load_s']:.1f}s")
    drafters, notes = resolve_drafters(args, target, args.target, log)
    result["notes"] = notes
    result["drafters"] = [{k: v for k, v in d.items() if k != "bundle"} for d in drafters]

    engines: dict = {}

    def gen(drafter=None, spec=SpecConfig()):
        spec = dataclasses.replace(spec, disable_by_batch_size=args.disable_by_batch_size)
        return Generator(target.cfg, target.params, target.tokenizer, drafter=drafter, spec=spec)

    engines["plain"] = H.EagleEngine("plain", gen(), method="plain")
    spec_names: list[str] = []
    for d in drafters:
        info = {k: v for k, v in d.items() if k != "bundle"}
        for k in st["chain_k"]:
            name = f"chain-k{k}/{d['tag']}"
            engines[name] = H.EagleEngine(name, gen(d["bundle"], SpecConfig(method="chain", num_speculative_tokens=k)),
                                          method="chain", drafter=info)
            spec_names.append(name)
        for t in st["trees"]:
            name = f"tree-{t}/{d['tag']}"
            engines[name] = H.EagleEngine(name, gen(d["bundle"], _tree(t)), method="tree", drafter=info)
            spec_names.append(name)

    t0 = time.perf_counter()
    n_short = max([st["num_prompts"], *st["batch_sizes"]])
    suite = ds.build_suite(target.tokenizer,
                           humaneval=n_short if "humaneval" in st["datasets"] else 0,
                           sharegpt=n_short if "sharegpt" in st["datasets"] else 0,
                           long_lengths=st["long_lengths"], long_per_length=st["long_per_length"],
                           sharegpt_max_tokens=st["sharegpt_max_tokens"])
    result["datasets"] = ds.summarize_suite(suite)
    log(f"prompt sets built in {time.perf_counter() - t0:.1f}s: "
        + ", ".join(f"{k} {len(v)}" for k, v in suite.items()))

    peer_names: list[str] = []

    def encode_text(text):
        return engines["plain"].gen.encode_prompts([text])[0]

    if args.peers and args.peers != ["none"]:
        from eagle_jax.benchmarks import peers as P

        longest = max(ds.chat_length(target.tokenizer, p.text) for name in st["datasets"] for p in suite[name])
        n_ctx = 512 * -(-(longest + st["max_new_tokens"] + 64) // 512)
        peer_engines, peer_status = P.build_peers(smollm2_gguf_path(), engines["plain"].gen.eos_ids(),
                                                  which=args.peers, n_ctx=n_ctx, log=log)
        if args.peer_threads == "auto":
            # one calibration per engine family; the prompt-lookup variant takes its sibling's setting
            probe = encode_text(suite[st["datasets"][0]][0].text)
            for name, e in peer_engines.items():
                sibling = peer_engines.get(name[:-len("-pld")]) if name.endswith("-pld") else None
                if sibling is not None and sibling.calibration:
                    e.set_threads(sibling.threads)
                    e.calibration = dict(sibling.calibration, inherited_from=name[:-len("-pld")])
                else:
                    P.calibrate_threads(e, probe, log=log)
        elif args.peer_threads:
            for e in peer_engines.values():
                e.set_threads(int(args.peer_threads))
        engines.update(peer_engines)
        peer_names = list(peer_engines)
        result["peers"] = peer_status
        if args.target != "smollm2-135m-instruct":
            log("note: peers always run the SmolLM2 GGUF")

    base_names = ["plain", *spec_names]
    workloads: list = []
    for temp in st["temperatures"]:
        for b in st["batch_sizes"]:
            for name in st["datasets"]:
                prompts = suite[name][:max(st["num_prompts"], b)]
                # the peers (batch 1, greedy) join the batch-1 greedy workloads, interleaved
                with_peers = b == 1 and temp == 0.0
                names = base_names + (peer_names if with_peers else [])
                limits = ({n: st["peer_batches"] for n in peer_names}
                          if with_peers and st["peer_batches"] else {})
                workloads.append(H.Workload(f"{name}/b{b}/T{temp:g}", name, b, temp, st["max_new_tokens"],
                                            prompts, names, group="short", max_batches=limits))
    for length in st["long_lengths"]:
        prompts = [p for p in suite.get("long", []) if p.meta["target_tokens"] == length]
        workloads.append(H.Workload(f"long/{length}/b1/T0", "long", 1, 0.0, st["max_new_tokens"], prompts,
                                    base_names, group=f"long-{length}", context_tokens=length))

    plain_gen = engines["plain"].gen
    cache: dict = {}

    def encode(p):
        if p.id not in cache:
            cache[p.id] = plain_gen.encode_prompts([p.text])[0]
        return cache[p.id]

    shapes = H.assign_shapes(workloads, {n: e for n, e in engines.items() if n in base_names}, encode)
    compiled: dict = {}
    result["workloads"] = []
    for w in workloads:
        log(f"workload {w.name}: {len(w.prompts)} prompts, engines {', '.join(w.engines)}")
        rec = H.run_workload(w, engines, encode, rounds=st["rounds"], shape=shapes[w.name],
                             compiled=compiled, seed=args.seed, log=log)
        result["workloads"].append(rec)
        result["total_s"] = time.perf_counter() - t_start
        result["path"] = _save(result, args, H, partial=True)
    result["memory_end"] = H.peak_memory()
    result["total_s"] = time.perf_counter() - t_start
    _drop_cold_cache(result)
    return result


def _compile_cache(args) -> dict:
    """Enable the persistent compilation cache (a fresh directory with --cold-cache)."""
    import tempfile

    from eagle_jax.runtime import enable_compilation_cache

    path = tempfile.mkdtemp(prefix="eagle-jax-bench-xla-") if getattr(args, "cold_cache", False) else None
    path = enable_compilation_cache(path)
    try:
        entries = None if path is None else len(os.listdir(path))
    except OSError:
        entries = None
    return {"dir": path, "cold": bool(getattr(args, "cold_cache", False)), "entries_at_start": entries}


def _drop_cold_cache(result) -> None:
    import shutil

    cc = result.get("compile_cache") or {}
    if cc.get("cold") and cc.get("dir"):
        shutil.rmtree(cc["dir"], ignore_errors=True)


_SAVED: dict = {}


def _save(result, args, H, partial=False) -> str:
    """Write (or rewrite) this run's JSON; the file name is fixed at the first write."""
    import json

    path = _SAVED.get(id(result))
    if path is None:
        path = H.write_result(result, args.output_dir, prefix=f"{result['suite']}-{result.get('mode', 'run')}")
        _SAVED[id(result)] = path
        return path
    result["partial"] = partial
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, default=H._json_default)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def print_summary(result: dict) -> None:
    for w in result.get("workloads", []):
        print(f"\n{w['name']}  ({w['num_prompts']} prompts, batch {w['batch_size']}, "
              f"T={w['temperature']:g}, {w['max_new_tokens']} new tokens)")
        print(f"  {'engine':28s} {'tok/s':>8s} {'tok/s/req':>9s} {'speedup':>8s} {'tau':>5s} "
              f"{'TTFT s':>7s} {'compile s':>9s}")
        for name, e in w["engines"].items():
            acc = e.get("acceptance") or {}
            tau = acc.get("acceptance_length")
            comp = e.get("compile_s")
            print(f"  {name:28s} {e['tokens_per_s_total']:8.1f} {e['tokens_per_s_per_request']:9.1f} "
                  f"{e['speedup']:8.2f} {tau if tau is None else round(tau, 2)!s:>5s} "
                  f"{(e['ttft_s_median'] or float('nan')):7.2f} "
                  f"{'-' if comp is None else f'{comp:.1f}':>9s}")


def main(args) -> int:
    if args.suite == "device":
        from eagle_jax.benchmarks import device_check

        argv = (["--dry-run"] if args.dry_run else []) + (["--output-dir", args.output_dir] if args.output_dir else [])
        argv += ["--dtype", args.dtype] if args.dtype else []
        return device_check.main(argv)
    from eagle_jax.benchmarks import harness as H

    log = H.Log()
    if args.suite == "report":
        from eagle_jax.benchmarks import report

        path = report.render(results_dir=args.output_dir, docs_path=args.docs)
        print(path)
        return 0
    if args.suite == "learning-curve":
        from eagle_jax.benchmarks import learning_curve, report

        if len(args.draft) != 1:
            raise SystemExit("--suite learning-curve measures one --draft (a drafter or a train/state/<variant> dir)")
        curve = os.path.join(args.output_dir or H.RESULTS_DIR, os.path.basename(learning_curve.CURVE_FILE))
        point = learning_curve.run_point(args.draft[0], args.label, target=args.target, curve=curve)
        print(learning_curve.summary_line(point))
        if not args.no_report:
            print(f"report: {report.render(results_dir=args.output_dir, docs_path=args.docs)}")
        return 0
    if args.suite == "plain-vs-transformers":
        from eagle_jax.benchmarks import plain_vs_transformers

        argv = ["--output-dir", args.output_dir] if args.output_dir else []
        return plain_vs_transformers.main(argv)
    if args.suite == "drift":
        from eagle_jax.benchmarks import drift

        result = drift.run(args, log)
    elif args.suite == "serve":
        from eagle_jax.benchmarks import serve_load

        result = serve_load.run(args, log)
    elif args.suite == "draft-policy":
        from eagle_jax.benchmarks import draft_policy

        result = draft_policy.run(args, log)
    elif args.suite == "step-cost":
        from eagle_jax.benchmarks import step_cost

        dtypes = (args.dtype,) if args.dtype else ("bfloat16", "float32")
        result = step_cost.run(dtypes, quick=args.quick, target=args.target, log=log)
    else:
        result = run_speed(args, log)
    result["partial"] = False
    path = _save(result, args, H)
    if args.suite == "speed":
        print_summary(result)
    print(f"\nresults: {path}")
    if not args.no_report:
        from eagle_jax.benchmarks import report

        print(f"report: {report.render(results_dir=args.output_dir, docs_path=args.docs)}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="eagle-jax bench")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
