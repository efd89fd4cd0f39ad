"""The draft-vocabulary size: held-out coverage against the drafter's step cost.

    python -m eagle_jax.benchmarks.draft_vocab [--sizes 2048,4096,8192,16384,32768]

A drafted token outside the draft vocabulary can never be accepted, so the
coverage of the target's held-out answers bounds the acceptance of every
drafted position; the draft head (hidden x Vd) is the drafter's largest
matrix, so its size sets much of the drafter's step cost. For each size:

* `coverage`: the fraction of held-out response tokens (the trainer's split
  of the regenerated data: `heldout_fraction` 0.02, seed 0) whose id is in a
  vocabulary built from the training split's frequencies, as the trainer
  builds it;
* `step_ms`: one drafter step (T = 1, a chain step) with random weights of the
  shipped EAGLE 3.1 drafter's shape at that size, median of interleaved calls,
  and `vs_8192` against 8,192 ids (the size shipped until stage 15) in the same run;
* `head_bytes`: the draft head's weight bytes;
* `shipped_vocab`: the coverage of the shipped EAGLE 3.1 drafter's own
  vocabulary (built from its first training data).

Results: benchmarks/results/draft_vocab-<date>-<machine>.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

DATA = "train/data/sharegpt-regen.jsonl.gz"
SIZES = (2048, 4096, 8192, 16384, 32768)


def coverages(data: str, sizes, target: str = "smollm2-135m-instruct", max_length: int = 448) -> dict:
    """Held-out and train coverage per size, of the shipped drafter's own
    vocabulary too, and the token counts."""
    import numpy as np

    from eagle_jax.convert.bundled import load_drafter_by_name
    from eagle_jax.convert.registry import load_target
    from eagle_jax.train import data as data_lib, vocab as vocab_lib
    from eagle_jax.train.datastore import read_conversations

    lt = load_target(target)
    train, held = data_lib.split_conversations(read_conversations(data, None), 0.02, seed=0)
    counts = {name: vocab_lib.token_frequencies(
        data_lib.tokenize_conversations(convs, lt.tokenizer.hf, max_length), lt.cfg.vocab_size)
        for name, convs in (("train", train), ("heldout", held))}
    out = {}
    for v in sizes:
        _, t2d = vocab_lib.build_draft_vocab(counts["train"], v, lt.cfg.vocab_size)
        out[v] = {"coverage": vocab_lib.coverage(counts["heldout"], t2d),
                  "train_coverage": vocab_lib.coverage(counts["train"], t2d)}
    _, _, shipped = load_drafter_by_name("default", lt.cfg, target)
    t2d = np.asarray(shipped.t2d, bool)
    out["shipped"] = {"size": int(t2d.sum()), "coverage": vocab_lib.coverage(counts["heldout"], t2d),
                      "train_coverage": vocab_lib.coverage(counts["train"], t2d)}
    return {"sizes": out, "train_tokens": int(counts["train"].sum()),
            "heldout_tokens": int(counts["heldout"].sum()), "conversations": [len(train), len(held)]}


def step_costs(sizes, rounds: int = 15, dtype: str = "bfloat16") -> dict:
    """{size: median ms of one drafter step at T = 1} with the shipped drafter's shape."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from eagle_jax.convert.bundled import load_drafter_by_name
    from eagle_jax.convert.registry import load_target
    from eagle_jax.models import drafter

    lt = load_target("smollm2-135m-instruct", dtype=dtype)
    shipped_cfg, _, _ = load_drafter_by_name("default", lt.cfg, "smollm2-135m-instruct", dtype=dtype)
    embed = lt.params["embed"]
    calls = {}
    for v in sizes:
        cfg = dataclasses.replace(shipped_cfg, draft_vocab_size=v)
        params = drafter.prepare_for_decoding(drafter.init_params(cfg, jax.random.PRNGKey(0), dtype=embed.dtype))
        cache = drafter.create_cache(cfg, 1, 320, embed.dtype).replace(lengths=jnp.array([256], jnp.int32))
        args = (jnp.full((1, 1), 42, jnp.int32), jnp.full((1, 1, cfg.hidden_size), 0.1, embed.dtype),
                jnp.full((1, 1), 256, jnp.int32))
        f = jax.jit(lambda p, c, tok, hid, pos, cfg=cfg: drafter.Drafter(cfg, p).step(tok, hid, pos, c,
                                                                                       embed=embed)[0])
        jax.block_until_ready(f(params, cache, *args))
        head = sum(x.nbytes for x in jax.tree.leaves(params["lm_head"]))
        calls[v] = (f, params, cache, args, head)
    times = {v: [] for v in sizes}
    for _ in range(rounds):  # interleaved: the machine's load moves all sizes alike
        for v, (f, p, c, args, _) in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(p, c, *args))
            times[v].append(1e3 * (time.perf_counter() - t0))
    return {v: {"step_ms": statistics.median(times[v]), "head_bytes": calls[v][4]} for v in sizes}


def run(sizes=SIZES, data: str = DATA, log=print) -> dict:
    from eagle_jax.benchmarks import harness as H

    result = H.result_header("draft_vocab")
    result["settings"] = {"data": data, "heldout_fraction": 0.02, "seed": 0, "dtype": "bfloat16",
                          "drafter": "smollm2-135m-eagle3.1 shape, random weights, T=1"}
    cov = coverages(data, sizes)
    cost = step_costs(sizes)
    base = cost.get(8192, cost[sizes[0]])["step_ms"]
    result.update({k: v for k, v in cov.items() if k != "sizes"})
    result["shipped_vocab"] = cov["sizes"]["shipped"]
    result["sizes"] = {str(v): {**cov["sizes"][v], **cost[v], "vs_8192": cost[v]["step_ms"] / base}
                       for v in sizes}
    log(f"shipped drafter's vocabulary ({result['shipped_vocab']['size']}): held-out coverage "
        f"{result['shipped_vocab']['coverage']:.4f} (train {result['shipped_vocab']['train_coverage']:.4f})")
    for v in sizes:
        r = result["sizes"][str(v)]
        log(f"Vd={v}: held-out coverage {r['coverage']:.4f} (train {r['train_coverage']:.4f}), "
            f"step {r['step_ms']:.2f} ms ({r['vs_8192']:.2f}x of 8192), head {r['head_bytes'] / 1e6:.1f} MB")
    return result


def main(argv=None) -> int:
    from eagle_jax.benchmarks import harness as H

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--data", default=DATA)
    p.add_argument("--output-dir", default=None)
    args = p.parse_args(argv)
    result = run(tuple(int(x) for x in args.sizes.split(",")), args.data)
    path = H.write_result(result, args.output_dir, prefix="draft_vocab")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
