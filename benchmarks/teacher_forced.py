"""Teacher-forced drafter accuracy on training vs held-out answers of the target.

    python -m eagle_jax.benchmarks.teacher_forced --data runs/data/sharegpt-regen.jsonl \
        --draft eagle_jax/drafters/smollm2-135m-eagle3.1 --draft eagle_jax/drafters/smollm2-135m-eagle3

The engine's acceptance on a few prompts is noisy (a handful of verify steps
per prompt). This measures the quantity training optimises, on every
response token: for TTT step i, the share of response positions where the
drafter's top-1 (in the draft vocabulary, mapped to target ids) equals the
target's greedy next token x_{t+2+i}, with the drafter fed the target's own
text (tests/spec/test_drafter_alignment.py holds the engine to the same
numbers). ``strict`` counts a target token outside the draft vocabulary as a
miss (what the engine sees); ``in_vocab`` leaves those out (what the training
loss sees).

Two sets, the same size: ``train``, the first regenerated (target-written)
conversations of ``--data`` in the training split; ``heldout``, the first user
turns of held-out ShareGPT conversations (train/data.py ``is_heldout``)
answered now by the target, greedy, like ``eagle-jax regenerate`` does for
training conversations. A large gap between the two is memorisation: more
regenerated data, not more steps, is what helps then.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["heldout_answers", "step_accuracy", "main"]


def heldout_answers(gen, n: int, max_new_tokens: int, max_prompt_tokens: int, heldout_fraction: float,
                    max_conversations: int = 2600) -> list[dict]:
    """{"id", "messages"} for the first `n` held-out ShareGPT first turns, answered by `gen`'s target."""
    from eagle_jax.train import data

    rows = []
    for conv in data.iter_sharegpt(limit=max_conversations):
        if not data.is_heldout(conv["id"], heldout_fraction):
            continue
        first = conv["messages"][:1]
        if not first or first[0]["role"] != "user":
            continue
        ids = gen.tokenizer.apply_chat(first, add_generation_prompt=True)
        if len(ids) <= max_prompt_tokens:
            rows.append((conv["id"], first, ids))
        if len(rows) >= n:
            break
    res = gen.generate([r[2] for r in rows], max_new_tokens=max_new_tokens, chat=False)
    return [{"id": cid, "messages": m + [{"role": "assistant", "content": text}]}
            for (cid, m, _), text in zip(rows, res.texts)]


def step_accuracy(tcfg, tparams, tokenizer, dcfg, dparams, vocab, convs, *, steps: int, seq_len: int) -> dict:
    """Token-weighted per-step accuracy of one drafter over `convs` (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from eagle_jax.train import data, features, ttt

    target_ids = jnp.asarray(vocab.target_ids, jnp.int32)
    t2d = jnp.asarray(vocab.t2d, bool)
    feat = features.make_feature_fn(tcfg, dcfg.aux_layer_ids)

    @jax.jit  # weights as arguments: closed-over weights would be constant-folded by XLA (minutes)
    def hits(tparams, dparams, tokens, lengths, mask):
        f = feat(tparams, tokens, target_ids, t2d)
        logits = ttt.unroll(dparams, dcfg, tparams["embed"], f.aux, tokens, lengths, steps)
        lm = mask.astype(jnp.float32)
        out = []
        for i, lg in enumerate(logits):
            n = tokens.shape[1] - 2 - i  # drafter positions with a label x_{t+2+i} in range
            label = tokens[:, 2 + i:]
            w = lm[:, 2 + i:]
            hit = (target_ids[jnp.argmax(lg[:, :n], -1)] == label).astype(jnp.float32)
            iv = f.in_vocab[:, 1 + i:1 + i + n].astype(jnp.float32)
            out.append(jnp.stack([jnp.sum(hit * w), jnp.sum(w), jnp.sum(hit * w * iv), jnp.sum(w * iv)]))
        return jnp.stack(out)

    examples = data.tokenize_conversations(convs, tokenizer.hf, seq_len)
    total = np.zeros((steps, 4))
    for e in examples:
        n = len(e["input_ids"])
        tokens = np.zeros((1, seq_len), np.int32)
        tokens[0, :n] = e["input_ids"]
        mask = np.zeros((1, seq_len), np.int32)
        mask[0, :n] = e["loss_mask"]
        total += np.asarray(hits(tparams, dparams, jnp.asarray(tokens), jnp.asarray([n], jnp.int32), jnp.asarray(mask)))
    return {"strict": [round(float(h / max(c, 1)), 4) for h, c, _, _ in total],
            "in_vocab": [round(float(h / max(c, 1)), 4) for _, _, h, c in total],
            "response_tokens": int(total[0, 1]), "conversations": len(examples)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_jax.benchmarks.teacher_forced", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="regenerated training JSONL (eagle-jax regenerate)")
    p.add_argument("--draft", action="append", required=True, help="drafter checkpoint dir (repeatable)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--num", type=int, default=24, help="conversations per set")
    p.add_argument("--steps", type=int, default=3, help="TTT steps measured")
    p.add_argument("--seq-len", type=int, default=448)
    p.add_argument("--max-new-tokens", type=int, default=160, help="held-out answers (as regenerated)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--heldout-fraction", type=float, default=0.02)
    p.add_argument("--output", default=None, help="JSON result (default benchmarks/results/teacher-forced-DATE.json)")
    args = p.parse_args(argv)

    from eagle_jax.convert.drafter_formats import load_drafter
    from eagle_jax.generate import Generator
    from eagle_jax.train import data
    from eagle_jax.train.cli import read_conversations

    t0 = time.perf_counter()
    gen = Generator.load(args.target, draft=None)
    held = heldout_answers(gen, args.num, args.max_new_tokens, args.max_prompt_tokens, args.heldout_fraction)
    train = [c for c in read_conversations(args.data, None)
             if not data.is_heldout(c["id"], args.heldout_fraction)
             and c["messages"][-1]["role"] == "assistant"][: args.num]
    result = {"command": "python -m eagle_jax.benchmarks.teacher_forced " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M"), "data": args.data, "drafters": {}}
    for path in args.draft:
        dcfg, dparams, vocab = load_drafter(path, gen.target_cfg)
        result["drafters"][path] = {
            name: step_accuracy(gen.target_cfg, gen.target_params, gen.tokenizer, dcfg, dparams, vocab, convs,
                                steps=args.steps, seq_len=args.seq_len)
            for name, convs in (("train", train), ("heldout", held))}
        r = result["drafters"][path]
        print(f"{path}: strict top-1 per TTT step  train {r['train']['strict']}  held-out {r['heldout']['strict']}",
              file=sys.stderr)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(args.output or f"benchmarks/results/teacher-forced-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
