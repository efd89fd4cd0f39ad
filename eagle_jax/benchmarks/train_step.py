"""Where a drafter training step goes, and what bfloat16 compute buys: feature pass and train step timed apart.

Usage: python -m eagle_jax.benchmarks.train_step [--json out.json] [--batches 4] [--draft-vocab-size 16384]

The real target (SmolLM2-135M-Instruct, float32 weights) and the first
`--batches` batches (4 x 448, length buckets) of the committed regenerated data
in the stage-2 config's order; the drafter starts from the shipped EAGLE 3.1
one (widened to `--draft-vocab-size` when larger, as `--set draft_vocab_size`
does). Three settings, one process: everything in float32; the target pass in
bfloat16 (``target_dtype``), the drafter in float32; both in bfloat16
(``dtype``; parameters and Adam's moments stay float32). For each, after a
compiling pass over the same batches, it times the feature pass
(`Trainer.batch_features`) and the jitted TTT train step (forward, backward,
AdamW), each averaged over the batches. It also reports the first step's loss
and per-TTT-step accuracy from the same drafter weights, so the settings can be
compared on what the drafter learns from, not only on time. Run it with nothing
else on the core (``taskset -c N``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import numpy as np

CONFIG = "train/configs/smollm2-eagle31-stage2.yaml"
DRAFTER = "eagle_jax/drafters/smollm2-135m-eagle3.1"


def _trainer(overrides: dict):
    from eagle_jax.train import cli
    from eagle_jax.train.trainer import Trainer

    args = argparse.Namespace(config=CONFIG, overrides=[f"{k}={v}" for k, v in overrides.items()])
    cfg = cli.load_config(args)
    lt, examples, vocab, _, _ = cli.prepare(cfg)
    return Trainer(cfg, lt.cfg, lt.params, examples, vocab, pad_id=0)


SETTINGS = [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16")]  # (dtype, target_dtype)


def measure(dtype: str, target_dtype: str, batches: int, draft_vocab_size: int, out_dir: str) -> dict:
    from eagle_jax.train.step import iter_batches

    tr = _trainer({"init_from": DRAFTER, "dtype": dtype, "target_dtype": target_dtype,
                   "draft_vocab_size": draft_vocab_size, "max_conversations": 400,
                   "output_dir": f"{out_dir}/{dtype}-{target_dtype}", "progress": "false", "eval_at_start": "false"})
    cfg = tr.cfg
    embed = jax.numpy.asarray(tr.tparams["embed"])
    data = [b for b, _ in zip(iter_batches(tr.examples, cfg.batch_size, cfg.seq_len, seed=cfg.seed,
                                           bucket_lengths=cfg.bucket_lengths), range(batches))]
    first = None
    times = {"features_s": [], "train_step_s": []}
    for rep in range(2):  # the first pass compiles every bucket shape
        state = tr.init_state()
        for i, batch in enumerate(data):
            t0 = time.perf_counter()
            feats = jax.block_until_ready(tr.batch_features(batch))
            t1 = time.perf_counter()
            state, m = tr.train_step(state, embed, feats)
            m = jax.device_get(m)
            t2 = time.perf_counter()
            if rep == 1:
                times["features_s"].append(t1 - t0)
                times["train_step_s"].append(t2 - t1)
            if rep == 0 and i == 0:
                first = {"loss": float(m["loss"]), "acc_i": [round(float(a), 4) for a in m["acc_i"]]}
    row = {"dtype": dtype, "target_dtype": target_dtype, "batches": batches, "padded_tokens": int(sum(
        np.prod(b["input_ids"].shape) for b in data)), "first_step": first}
    row.update({k: float(np.mean(v)) for k, v in times.items()})
    row["step_s"] = row["features_s"] + row["train_step_s"]
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--draft-vocab-size", type=int, default=16384)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype, td in SETTINGS:
            r = measure(dtype, td, args.batches, args.draft_vocab_size, tmp)
            rows.append(r)
            print(f"dtype {dtype}, target pass {td}: features {r['features_s']:.2f} s + train step {r['train_step_s']:.2f} s "
                  f"= {r['step_s']:.2f} s a step; first step loss {r['first_step']['loss']:.4f}, "
                  f"acc {r['first_step']['acc_i']}", flush=True)
    for r in rows[1:]:
        r["speedup"] = rows[0]["step_s"] / r["step_s"]
        print(f"dtype {r['dtype']}, target pass {r['target_dtype']}: {r['speedup']:.2f}x the steps per second")
    if args.json:
        cmd = "python -m eagle_jax.benchmarks.train_step" + (
            f" --batches {args.batches}" if args.batches != 4 else "") + (
            f" --draft-vocab-size {args.draft_vocab_size}" if args.draft_vocab_size != 16384 else "")
        with open(args.json, "w") as f:
            json.dump({"command": cmd, "machine": jax.devices()[0].device_kind, "results": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
