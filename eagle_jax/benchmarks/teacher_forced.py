"""Teacher-forced drafter accuracy on training vs held-out answers of the target.

    python -m eagle_jax.benchmarks.teacher_forced --data runs/data/sharegpt-regen.jsonl \
        --draft eagle_jax/drafters/smollm2-135m-eagle3.1 --draft eagle_jax/drafters/smollm2-135m-eagle3

The engine's acceptance on a few prompts is noisy (a handful of verify steps
per prompt). This measures the quantity training optimises, on every
response token: for TTT step i, the share of response positions where the
drafter's top-1 (in the draft vocabulary, mapped to target ids) equals the
target's greedy next token x_{t+2+i}, with the drafter fed the target's own
text (tests/spec_decode/test_drafter_alignment.py holds the engine to the same
numbers). ``strict`` counts a target token outside the draft vocabulary as a
miss (what the engine sees); ``in_vocab`` leaves those out (what the training
loss sees). A parallel drafter (P-EAGLE) is measured the same way: its step i
is slot i of its one forward (train/ttt.py).

``tau``: the tokens per verify step of greedy chain drafting with ``--steps``
tokens over each answer, simulated from the strict hits (`chain_tau`): exact for
text the target wrote greedily, as test_drafter_alignment.py checks against the
engine for sequential drafting; for a parallel drafter it is the tau its one-forward
chain would reach, which the engine cannot run yet.

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
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.train import data, features, ttt

__all__ = ["heldout_answers", "step_accuracy", "chain_tau", "main"]


def heldout_answers(gen, n: int, max_new_tokens: int, max_prompt_tokens: int, heldout_fraction: float,
                    max_conversations: int = 2600) -> list[dict]:
    """{"id", "messages"} for the first `n` held-out ShareGPT first turns, answered by `gen`'s target."""
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


@partial(jax.jit, static_argnames=("tcfg", "dcfg", "steps"))
def _hit_counts(tparams, dparams, target_ids, t2d, tokens, lengths, mask, *, tcfg, dcfg, steps):
    """([steps, 4] sums over a batch: strict hits, response tokens, in-vocab hits, in-vocab tokens;
    bool [steps, B, T]: the strict hit of step i at drafter position t, i.e. on x_{t+2+i})."""
    aux, _, in_vocab = features.target_features(tparams, tcfg, tokens, aux_layers=dcfg.aux_layer_ids,
                                                head=features.draft_head(tparams, tcfg, target_ids), t2d=t2d)
    logits = ttt.unroll(dparams, dcfg, tparams["embed"], aux, tokens, lengths, steps)
    out, hits = [], []
    for i, lg in enumerate(logits):
        n = tokens.shape[1] - 2 - i  # drafter positions with a label x_{t+2+i} in range
        w = mask[:, 2 + i:].astype(jnp.float32)
        hit = (target_ids[jnp.argmax(lg[:, :n], -1)] == tokens[:, 2 + i:]).astype(jnp.float32)
        iv = in_vocab[:, 1 + i:1 + i + n].astype(jnp.float32)
        out.append(jnp.stack([jnp.sum(hit * w), jnp.sum(w), jnp.sum(hit * w * iv), jnp.sum(w * iv)]))
        hits.append(jnp.pad(hit * w > 0, ((0, 0), (0, 2 + i))))
    return jnp.stack(out), jnp.stack(hits)


def chain_tau(hits: np.ndarray, mask: np.ndarray) -> tuple[int, int]:
    """(emitted tokens, verify steps) of greedy chain drafting of k tokens over one row's
    answers, from its teacher-forced hits (bool [k, T]: step i at drafter position t drafted
    x_{t+2+i} right) and loss mask [T] (1 on answer tokens). Each answer's first token is the
    target's own (prefill); then each verify step accepts the leading hits of the chain rooted
    at the last emitted token and emits one more, the last step cut at the answer's end."""
    k = hits.shape[0]
    emitted = steps = 0
    m = np.r_[0, np.asarray(mask, np.int8), 0]
    starts, ends = np.flatnonzero(np.diff(m) == 1), np.flatnonzero(np.diff(m) == -1)  # answers [s, e)
    for s, e in zip(starts, ends):
        t = s - 1  # the root x_{t+1} = x_s, the answer's first token, is emitted
        while e - t - 2 > 0:  # tokens x_{t+2} .. x_{e-1} still to emit
            left = e - t - 2
            j = 0
            while j < min(k, left) and hits[j, t]:
                j += 1
            n = min(j + 1, left)
            emitted, steps, t = emitted + n, steps + 1, t + n
    return emitted, steps


def step_accuracy(tcfg, tparams, tokenizer, dcfg, dparams, vocab, convs, *, steps: int, seq_len: int,
                  batch_size: int = 8) -> dict:
    """Token-weighted per-step accuracy of one drafter over `convs` (see the module docstring)."""
    examples = data.tokenize_conversations(convs, tokenizer.hf, seq_len)
    target_ids = jnp.asarray(vocab.target_ids, jnp.int32)
    t2d = jnp.asarray(vocab.t2d, bool)
    total = np.zeros((steps, 4))
    emitted = verify_steps = 0
    for start in range(0, len(examples), batch_size):  # the last batch is padded with empty rows
        tokens = np.zeros((batch_size, seq_len), np.int32)
        mask = np.zeros((batch_size, seq_len), np.int32)
        lengths = np.zeros((batch_size,), np.int32)
        for r, e in enumerate(examples[start:start + batch_size]):
            n = lengths[r] = len(e["input_ids"])
            tokens[r, :n], mask[r, :n] = e["input_ids"], e["loss_mask"]
        counts, hits = _hit_counts(tparams, dparams, target_ids, t2d, jnp.asarray(tokens), jnp.asarray(lengths),
                                   jnp.asarray(mask), tcfg=tcfg, dcfg=dcfg, steps=steps)
        total += np.asarray(counts)
        hits = np.asarray(hits)
        for r in range(batch_size):
            e, n = chain_tau(hits[:, r], mask[r])
            emitted, verify_steps = emitted + e, verify_steps + n
    return {"strict": [round(float(h / max(c, 1)), 4) for h, c, _, _ in total],
            "in_vocab": [round(float(h / max(c, 1)), 4) for _, _, h, c in total],
            "tau": round(emitted / max(verify_steps, 1), 4), "verify_steps": verify_steps,
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
    from eagle_jax.convert.registry import load_target
    from eagle_jax.generate import Generator
    from eagle_jax.runtime import enable_compilation_cache
    from eagle_jax.train.datastore import read_conversations

    t0 = time.perf_counter()
    enable_compilation_cache()
    lt = load_target(args.target)
    gen = Generator(lt.cfg, lt.params, lt.tokenizer)
    held = heldout_answers(gen, args.num, args.max_new_tokens, args.max_prompt_tokens, args.heldout_fraction)
    train = [c for c in read_conversations(args.data, None)
             if not data.is_heldout(c["id"], args.heldout_fraction)
             and c["messages"][-1]["role"] == "assistant"][: args.num]
    result = {"command": "python -m eagle_jax.benchmarks.teacher_forced " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M"), "data": args.data, "drafters": {}}
    out = Path(args.output or f"benchmarks/results/teacher-forced-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for path in args.draft:
        dcfg, dparams, vocab = load_drafter(path, lt.cfg)
        result["drafters"][path] = {
            # the stacked weights (a scan over layers): the generator's unrolled copy compiles for minutes
            name: step_accuracy(lt.cfg, lt.params, lt.tokenizer, dcfg, dparams, vocab, convs,
                                steps=args.steps, seq_len=args.seq_len)
            for name, convs in (("train", train), ("heldout", held))}
        r = result["drafters"][path]
        print(f"{path}: strict top-1 per TTT step  train {r['train']['strict']}  held-out {r['heldout']['strict']}"
              f"  chain tau (k={args.steps}) train {r['train']['tau']}  held-out {r['heldout']['tau']}",
              file=sys.stderr)
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(result, indent=1) + "\n")  # after each drafter: a cut-short run keeps it
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
