"""Plain greedy decoding: eagle-jax vs transformers `generate`, same weights, one run.

    python benchmarks/plain_vs_transformers.py [--max-new-tokens 128] [--rounds 3]
    eagle-jax bench --suite plain-vs-transformers

SmolLM2-135M-Instruct from the shipped GGUF, float32 in both engines
(eagle-jax: its converter; transformers: `gguf_file=`, dequantised), batch
1, greedy, the same chat prompt as token ids, 128 new tokens. Reported:

* tokens/s of each engine over `rounds` interleaved timed runs (E, T, E, T,
  ...) and their ratio (median of the paired ratios, and ratio of medians);
  target: eagle-jax >= 1.5x transformers;
* eagle-jax `compile_s` (first call minus the second) and the second-call time;
* warm start: wall time of a fresh subprocess `eagle-jax generate --prompt ...
  --draft none --max-new-tokens 128 --json` once the persistent compilation
  cache is filled (the subprocess is run once to fill it, then timed twice);
  target: < 10 s. A second child process reports where that time goes
  (imports, target load, Generator, first cached-compile call, decode);
* a decode-step profile: one jitted target step (batch 1, one token) in
  isolation vs the tokens/s of the whole loop, and the time that step would
  take at the machine's measured memory bandwidth if it only had to read the
  weights once (the roofline for decoding at batch 1).

The JSON goes to benchmarks/results/plain_vs_transformers-<date>-<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = ("Write a detailed, multi-paragraph short story about a lighthouse keeper who finds a "
          "message in a bottle. Describe the setting, the characters and what happens next.")


def _child_breakdown(max_new: int) -> None:
    """Run in a fresh process: phase timings of a warm start, printed as JSON."""
    t0 = time.perf_counter()
    import jax  # noqa: F401

    t_jax = time.perf_counter()
    from eagle_jax.generate import Generator

    t_imp = time.perf_counter()
    from eagle_jax.convert.registry import load_target
    from eagle_jax.runtime import enable_compilation_cache

    enable_compilation_cache()
    t = load_target("smollm2-135m-instruct", dtype="float32")
    t_load = time.perf_counter()
    gen = Generator(t.cfg, t.params, t.tokenizer)
    ids = gen.encode_prompts([PROMPT])
    t_tok = time.perf_counter()
    r = gen.generate(ids, max_new_tokens=max_new)
    t_first = time.perf_counter()
    r2 = gen.generate(ids, max_new_tokens=max_new)
    t_second = time.perf_counter()
    print(json.dumps({
        "import_jax_s": t_jax - t0, "import_eagle_jax_s": t_imp - t_jax,
        "load_target_s": t_load - t_imp, "generator_and_tokenize_s": t_tok - t_load,
        "first_generate_s": t_first - t_tok, "first_generate_inner_wall_s": r.wall_s,
        "second_generate_s": t_second - t_first, "tokens": r.num_generated,
        "cache_load_overhead_s": (t_first - t_tok) - r2.wall_s}))


def _timed_subprocess(cmd: list[str], env=None) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    out = {"wall_s": wall, "returncode": p.returncode}
    line = next((l for l in reversed(p.stdout.strip().splitlines()) if l.startswith("{")), None)
    if line:
        try:
            out["json"] = json.loads(line)
        except json.JSONDecodeError:
            pass
    if p.returncode != 0:
        out["stderr_tail"] = p.stderr[-2000:]
    return out


def _eagle_cli() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "eagle-jax")
    return [exe] if os.path.isfile(exe) else [sys.executable, "-m", "eagle_jax.cli"]


def memory_bandwidth_gbs(mb: int = 512, repeats: int = 5) -> dict:
    """Read+write bandwidth of a large array copy (numpy and jitted XLA `x + 1`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = mb * 2**20 // 4
    a = np.ones(n, np.float32)
    b = np.empty_like(a)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t0)
    numpy_gbs = 2 * a.nbytes / min(ts) / 1e9
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda v: v + 1.0, donate_argnums=0)  # in place: no fresh 512 MB buffer per call
    x = f(x).block_until_ready()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = f(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    xla_gbs = 2 * a.nbytes / min(ts) / 1e9
    return {"array_mb": mb, "numpy_copy_gbs": numpy_gbs, "xla_add_gbs": xla_gbs}


def median_ms(f, *args, repeats: int = 20) -> float:
    """Median ms of f(*args) (jitted), after one warm-up call."""
    import jax

    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def layer_matmuls(params, cfg, x):
    """The weight matmuls of every layer (x @ wqkv, wo, w_gate_up, w_down), nothing else.

    params: per-layer buffers (`target.unstack_layers`); x [M, H]. Returns x [M, H].
    """
    import jax.numpy as jnp

    for p in params["layers"].values():
        q = jnp.dot(x, p["wqkv"])[:, :cfg.q_size]
        x = x + jnp.dot(q, p["wo"])
        gu = jnp.dot(x, p["w_gate_up"])
        x = x + jnp.dot(gu[:, :cfg.intermediate_size] * gu[:, cfg.intermediate_size:], p["w_down"])
        x = x * 0.5
    return x


def decode_step_profile(gen, ids, cache_len: int, repeats: int = 20) -> dict:
    """Where one decode step's time goes (batch 1, one token, float32).

    * the full step (the Target call + final norm + lm_head + argmax), isolated;
    * the decoding loop's time per token with KV-cache buffers of 192 ... 8192
      slots and the same short prompt (attention reads every slot of the buffer);
    * the same step's weight matmuls alone (an unrolled loop over the layers doing
      x @ wqkv, x @ wo, x @ w_gate_up, x @ w_down, then the lm_head), the
      part a weight-read roofline describes;
    * the lm_head matmul alone (the tied 49152 x 576 embedding, 21 % of the bytes).
    """
    import jax
    import jax.numpy as jnp

    from eagle_jax.generate import Generator
    from eagle_jax.models import target

    cfg, params = gen.target_cfg, gen.target_params

    @jax.jit
    def one(params, tok, pos, cache):
        model = target.Target(cfg, params)
        h, cache, _ = model(tok, pos, cache)
        return jnp.argmax(model.logits(h[:, 0]), -1), cache

    tok = jnp.array([[ids[0][-1]]], jnp.int32)
    out = {}
    cache = target.create_cache(cfg, 1, cache_len, params["embed"].dtype)
    cache = cache.replace(lengths=jnp.array([len(ids[0]) + 64], jnp.int32))
    out["step_ms_median"] = median_ms(one, params, tok, cache.lengths[:, None], cache, repeats=repeats)
    # the decoding loop itself (in place, no cache copy) with larger KV-cache buffers and
    # the same short prompt: attention reads every slot of the static buffer
    shaped = Generator(cfg, params, gen.tokenizer)
    lengths = (cache_len, 1024, 4096, 8192)
    for n in lengths:  # compile each buffer size first
        shaped.min_shapes = (0, n, 0)  # raised only: outputs unchanged
        shaped.generate(ids, max_new_tokens=4)
    loop_ms: dict = {str(n): [] for n in lengths}
    for _ in range(3):  # round-robin over the sizes; the minimum is the least disturbed run
        for n in lengths:
            shaped.min_shapes = (0, n, 0)
            r = shaped.generate(ids, max_new_tokens=48)
            loop_ms[str(n)].append(1e3 * r.timings["decode_s"] / max(r.num_generated - 1, 1))
    out["loop_ms_per_token_by_cache_len"] = {k: min(v) for k, v in loop_ms.items()}
    out["loop_ms_per_token_by_cache_len_all"] = loop_ms

    @jax.jit
    def matmuls(params, x):  # params with per-layer buffers, as the Generator decodes on CPU
        x = layer_matmuls(params, cfg, x)
        return jnp.argmax(jnp.dot(x, target.Target(cfg, params).lm_head_weight()), -1)

    x = jnp.ones((1, cfg.hidden_size), params["embed"].dtype) * 0.01
    out["matmuls_only_ms"] = median_ms(matmuls, target.unstack_layers(params), x, repeats=repeats)
    head = jax.jit(lambda w, x: jnp.argmax(jnp.dot(x, w), -1))
    out["lm_head_only_ms"] = median_ms(head, target.Target(cfg, params).lm_head_weight(), x, repeats=repeats)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cache_len * cfg.head_dim * 4
    out.update({"weight_bytes": nbytes, "kv_cache_bytes_read": kv_bytes, "cache_len": cache_len})
    return out


def run(args) -> dict:
    import jax

    from eagle_jax.benchmarks import harness as H
    from eagle_jax.benchmarks import peers as P
    from eagle_jax.convert.registry import load_target, smollm2_gguf_path
    from eagle_jax.generate import Generator
    from eagle_jax.runtime import enable_compilation_cache

    log = H.Log()
    result = H.result_header("plain_vs_transformers", args.argv)
    result["settings"] = {"max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "batch_size": 1,
                          "dtype": "float32", "prompt": PROMPT}
    # A fresh persistent-cache directory: compile_s is a cold compile, and the
    # warm-start subprocesses then find exactly what this process compiled.
    xla_cache = tempfile.mkdtemp(prefix="eagle-jax-xla-")
    enable_compilation_cache(xla_cache)
    env = dict(os.environ, EAGLE_JAX_XLA_CACHE=xla_cache)
    result["compile_cache"] = "fresh"
    t0 = time.perf_counter()
    t = load_target("smollm2-135m-instruct", dtype="float32")
    gen = Generator(t.cfg, t.params, t.tokenizer)
    ids = gen.encode_prompts([PROMPT])
    result["settings"]["prompt_tokens"] = len(ids[0])
    result["eagle_jax_load_s"] = time.perf_counter() - t0
    n = args.max_new_tokens
    r1 = gen.generate(ids, max_new_tokens=n)
    r2 = gen.generate(ids, max_new_tokens=n)
    result["eagle_jax_first_call_s"] = r1.wall_s
    result["eagle_jax_second_call_s"] = r2.wall_s
    result["eagle_jax_compile_s"] = r1.wall_s - r2.wall_s
    log(f"eagle-jax: first call {r1.wall_s:.2f}s, second {r2.wall_s:.2f}s ({r2.num_generated} tokens)")

    t0 = time.perf_counter()
    model = P.load_transformers_model(smollm2_gguf_path())
    result["transformers_load_s"] = time.perf_counter() - t0
    hf = P.TransformersEngine("transformers", model, gen.eos_ids())
    hf.run(ids, 8, 0.0, 0)  # warm-up (allocator, kernels)
    # threads: the faster of 1 and all cores (see benchmarks/peers.py; on a shared
    # machine 2 OpenMP threads can be several times slower than 1)
    P.calibrate_threads(hf, ids[0], log=log)
    result["transformers_threads"] = hf.threads
    result["transformers_thread_calibration"] = hf.calibration
    rows = []
    for r in range(args.rounds):
        pair = {}
        for name in (("eagle-jax", "transformers") if r % 2 == 0 else ("transformers", "eagle-jax")):
            if name == "eagle-jax":
                g = gen.generate(ids, max_new_tokens=n)
                pair[name] = {"tokens": g.num_generated, "wall_s": g.wall_s, "ttft_s": g.ttft_s,
                              "token_ids": g.token_ids[0]}
            else:
                h = hf.run(ids, n, 0.0, 0)
                pair[name] = {"tokens": len(h.token_ids[0]), "wall_s": h.wall_s, "ttft_s": h.ttft_s,
                              "token_ids": h.token_ids[0]}
            pair[name]["tokens_per_s"] = pair[name]["tokens"] / pair[name]["wall_s"]
        rows.append(pair)
        log(f"round {r}: eagle-jax {pair['eagle-jax']['tokens_per_s']:.1f} tok/s, "
            f"transformers {pair['transformers']['tokens_per_s']:.1f} tok/s")
    same = sum(x["eagle-jax"]["token_ids"] == x["transformers"]["token_ids"] for x in rows)
    common = []
    for x in rows:
        a, b = x["eagle-jax"]["token_ids"], x["transformers"]["token_ids"]
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        common.append(k)
    for x in rows:
        for v in x.values():
            v.pop("token_ids")
    e_tps = [x["eagle-jax"]["tokens_per_s"] for x in rows]
    h_tps = [x["transformers"]["tokens_per_s"] for x in rows]
    result["rounds"] = rows
    result["eagle_jax_tokens_per_s"] = statistics.median(e_tps)
    result["transformers_tokens_per_s"] = statistics.median(h_tps)
    result["ratio_paired_median"] = statistics.median(e / h for e, h in zip(e_tps, h_tps))
    result["ratio_of_medians"] = result["eagle_jax_tokens_per_s"] / result["transformers_tokens_per_s"]
    result["eagle_jax_ttft_s"] = statistics.median(x["eagle-jax"]["ttft_s"] for x in rows)
    result["transformers_ttft_s"] = statistics.median(x["transformers"]["ttft_s"] for x in rows
                                                      if x["transformers"]["ttft_s"] is not None)
    result["same_tokens_rounds"] = same
    result["common_prefix_tokens"] = common
    result["target_ratio"] = 1.5
    result["ratio_target_met"] = result["ratio_paired_median"] >= 1.5
    del model, hf

    # warm start: a fresh process with the persistent compilation cache filled
    cmd = _eagle_cli() + ["generate", "--prompt", PROMPT, "--draft", "none",
                          "--max-new-tokens", str(n), "--json"]
    result["warm_start_command"] = shlex.join(["eagle-jax", *cmd[1:]] if cmd[0].endswith("eagle-jax") else cmd)
    fill = _timed_subprocess(cmd, env)
    runs = [_timed_subprocess(cmd, env) for _ in range(2)]
    result["warm_start_fill_s"] = fill["wall_s"]
    result["warm_start_runs"] = runs
    result["warm_start_s"] = min(r["wall_s"] for r in runs)
    result["warm_start_target_s"] = 10.0
    result["warm_start_target_met"] = result["warm_start_s"] < 10.0 and all(r["returncode"] == 0 for r in runs)
    times = ", ".join("%.1fs" % r["wall_s"] for r in runs)
    log(f"warm start: fill {fill['wall_s']:.1f}s, then {times}")
    child = _timed_subprocess([sys.executable, os.path.abspath(__file__), "--child-breakdown",
                               "--max-new-tokens", str(n)], env)
    result["warm_start_breakdown"] = child.get("json", child)
    result["warm_start_breakdown"]["process_wall_s"] = child["wall_s"]

    # where the decode time goes
    steps_s = (r2.timings["decode_s"]) / max(r2.num_generated - 1, 1)
    # the profiled step sits 64 tokens past the prompt: its slot must be inside the cache
    prof = decode_step_profile(gen, ids, cache_len=64 * ((len(ids[0]) + max(n, 65) + 2 + 63) // 64))
    bw = memory_bandwidth_gbs()
    best_bw = max(bw["numpy_copy_gbs"], bw["xla_add_gbs"])
    prof.update(bw)
    prof["loop_ms_per_token"] = 1e3 * steps_s
    prof["roofline_ms_per_token"] = 1e3 * (prof["weight_bytes"] + prof["kv_cache_bytes_read"]) / (best_bw * 1e9)
    prof["step_bandwidth_gbs"] = (prof["weight_bytes"] + prof["kv_cache_bytes_read"]) / (prof["step_ms_median"] / 1e3) / 1e9
    prof["transformers_ms_per_token"] = 1e3 / result["transformers_tokens_per_s"]
    result["profile"] = prof
    result["backend"] = jax.default_backend()
    shutil.rmtree(xla_cache, ignore_errors=True)
    log(f"profile: step {prof['step_ms_median']:.1f} ms isolated, {prof['loop_ms_per_token']:.1f} ms in the loop, "
        f"weights-only roofline {prof['roofline_ms_per_token']:.1f} ms at {best_bw:.1f} GB/s")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="plain_vs_transformers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--child-breakdown", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_breakdown:
        _child_breakdown(args.max_new_tokens)
        return 0
    args.argv = None  # the command is sys.argv (script or `eagle-jax bench`)
    from eagle_jax.benchmarks import harness as H

    result = run(args)
    path = H.write_result(result, args.output_dir, prefix="plain_vs_transformers")
    print(json.dumps({k: result[k] for k in (
        "eagle_jax_tokens_per_s", "transformers_tokens_per_s", "ratio_paired_median", "ratio_of_medians",
        "eagle_jax_compile_s", "eagle_jax_second_call_s", "warm_start_s")}, indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
