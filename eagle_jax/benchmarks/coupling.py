"""Acceptance of the coupled (Gumbel-max) sampler against rejection sampling.

Usage: python -m eagle_jax.benchmarks.coupling [--json out.json] [--seeds 4] [--max-new-tokens 96]

The embedded default target with its shipped drafter, the smoke prompts
(benchmarks/prompts/smoke4.jsonl, chat-templated), each with `seeds` seeds,
in one static batch (engine/batch.py) per (method, temperature, sampler):
the default chain and the default tree (3x2x6), temperatures 0.3, 0.7 and
1.0, no top-k / top-p. Both samplers run the same compiled programs (the
sampler is a per-row array) on the same prompts and seeds. Reported: tau
(tokens per verify step, 1 + accepted) and the acceptance rate per drafted
position, over every row, and the batch's seconds per verify step.

Then the cost of a step (`--step-rows`, default 1 and 4 rows of the first
prompt, 16 tokens in): `loop.step_jit` at the full depth on two states,
one a sampler, stepped in turn `--step-repeats` times; the least time of
each (a run of other work on the machine slows one step of each, not all of
one).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from eagle_jax.config import SpecConfig
from eagle_jax.engine.batch import batch_inputs, run_batch
from eagle_jax.engine.request import Sampling
from eagle_jax.generate import Generator
from eagle_jax.spec_decode import loop
from eagle_jax.spec_decode.stats import summarize

PROMPTS = Path(__file__).parent / "prompts" / "smoke4.jsonl"
METHODS = {"chain": SpecConfig(disable_by_batch_size=None),
           "tree": SpecConfig(method="tree", disable_by_batch_size=None)}
TEMPERATURES = (0.3, 0.7, 1.0)


def step_ms(gen: Generator, ids: list[int], rows: int, repeats: int) -> dict:
    """{"rejection": ms, "coupled": ms}: the least time of a full-depth step over `rows` rows of ids,
    temperature 1, the two samplers' states stepped in turn."""
    states = {}
    for coupled in (False, True):
        reqs = [Sampling(max_new_tokens=1024, temperature=1.0, seed=r, coupled=coupled) for r in range(rows)]
        lc, args, static = batch_inputs(gen, [ids] * rows, reqs)
        dparams, vocab = gen.drafter_for(lc)
        state = loop.prefill_jit(gen.target_params, dparams, vocab, *args, **static)
        for _ in range(16):  # compiles, and leaves the prompt behind
            state = loop.step_jit(gen.target_params, dparams, vocab, state, lc=lc)
        states[coupled] = [lc, dparams, vocab, state]
    best = {False: float("inf"), True: float("inf")}
    for _ in range(repeats):
        for coupled, (lc, dparams, vocab, state) in states.items():
            t0 = time.perf_counter()
            state = loop.step_jit(gen.target_params, dparams, vocab, state, lc=lc)
            jax.block_until_ready(state.num_generated)
            best[coupled] = min(best[coupled], time.perf_counter() - t0)
            states[coupled][3] = state
    return {"rejection": 1e3 * best[False], "coupled": 1e3 * best[True]}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--step-rows", type=int, nargs="*", default=[1, 4])
    p.add_argument("--step-repeats", type=int, default=20)
    p.add_argument("--skip-acceptance", action="store_true", help="only time the steps")
    args = p.parse_args(argv)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    rows, steps = [], []
    for method, spec in METHODS.items():
        gen = Generator.load(spec=spec)
        for b in args.step_rows:
            steps.append({"method": method, "rows": b, **step_ms(gen, gen.encode_prompts(prompts[:1])[0], b,
                                                                  args.step_repeats)})
            print(json.dumps(steps[-1]))
        if args.skip_acceptance:
            continue
        ids = gen.encode_prompts(prompts) * args.seeds
        batch = lambda t, coupled: [Sampling(max_new_tokens=args.max_new_tokens, temperature=t,
                                             seed=r // len(prompts), seed_stream=r % len(prompts), coupled=coupled)
                                    for r in range(len(ids))]
        run_batch(gen, ids, batch(1.0, True))  # compiles: every run below shares its programs
        for t in TEMPERATURES:
            for coupled in (False, True):
                out = run_batch(gen, ids, batch(t, coupled))
                s = summarize(out.stats)
                row = {"method": method, "temperature": t, "sampler": "coupled" if coupled else "rejection",
                       "tau": s["acceptance_length"], "accept_per_position": s["per_position_acceptance"],
                       "verify_steps": s["num_verify_steps"], "tokens": int(out.num_generated.sum()),
                       "s_per_step": (out.wall_s - out.ttft_s) / max(int(out.stats.steps.max()), 1)}
                rows.append(row)
                print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m eagle_jax.benchmarks.coupling " + " ".join(argv or []),
                       "machine": jax.devices()[0].device_kind, "prompts": str(PROMPTS.name),
                       "seeds": args.seeds, "max_new_tokens": args.max_new_tokens,
                       "date": time.strftime("%Y-%m-%d"), "results": rows, "step_ms": steps}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
