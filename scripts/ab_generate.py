"""Before/after A/B of the public generation API on one tree (issue 43's same-run ratios).

    python scripts/ab_generate.py --out before.json            # run once per tree, alternately:
    PYTHONPATH=/tmp/before python scripts/ab_generate.py --out before.json
    python scripts/ab_generate.py --out after.json

For plain decoding, chain k=3 and the default tree on SmolLM2-135M + the bundled
EAGLE 3.1 drafter (speculation forced on: --disable-by-batch-size none), at batch 1:
`generate` and `stream` tokens/s (best of --repeat, after a warm-up call), the
first `stream` call's seconds (what builds its programs), the compiles counted
during the timed calls, and the greedy ids (which must agree across trees).
"""

from __future__ import annotations

import argparse
import json
import time

import jax

import eagle_jax
from eagle_jax.config import SpecConfig
from eagle_jax.generate import Generator

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain in three sentences why the sky is blue."]
SPECS = {"plain": None, "chain-k3": SpecConfig("chain", num_speculative_tokens=3, disable_by_batch_size=None),
         "tree": SpecConfig(disable_by_batch_size=None)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _s, **_: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    out = {"package": eagle_jax.__file__, "runs": {}}
    for name, spec in SPECS.items():
        gen = (Generator.load(draft=None) if spec is None else Generator.load(spec=spec))
        row = {"generate_tok_s": [], "stream_tok_s": [], "ids": []}
        t0 = time.perf_counter()
        list(gen.stream(PROMPTS[0], max_new_tokens=8))
        row["first_stream_s"] = round(time.perf_counter() - t0, 2)
        for p in PROMPTS:
            gen.generate([p], max_new_tokens=args.max_new_tokens)  # warm-up: compiles this shape
            list(gen.stream(p, max_new_tokens=args.max_new_tokens))
        before = len(compiles)
        for p in PROMPTS:
            best_g = best_s = 0.0
            for _ in range(args.repeat):
                r = gen.generate([p], max_new_tokens=args.max_new_tokens)
                n = len(r.token_ids[0])
                best_g = max(best_g, n / r.wall_s)
                t0 = time.perf_counter()
                text = "".join(gen.stream(p, max_new_tokens=args.max_new_tokens))
                best_s = max(best_s, n / (time.perf_counter() - t0))
                assert text == r.texts[0], (name, p)
            row["generate_tok_s"].append(round(best_g, 2))
            row["stream_tok_s"].append(round(best_s, 2))
            row["ids"].append(r.token_ids[0])
        row["compiles_while_timed"] = len(compiles) - before
        out["runs"][name] = row
        print(name, {k: v for k, v in row.items() if k != "ids"}, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
