"""`eagle-jax regenerate`: rewrite assistant turns with the target itself.

    eagle-jax regenerate --output runs/data/sharegpt-regen.jsonl --max-conversations 400 \
        --skip-ids-from train/data/sharegpt-regen.jsonl.gz
    python -P -m eagle_jax.train.datastore merge runs/data/sharegpt-regen.jsonl train/data/sharegpt-regen.jsonl.gz
    eagle-jax train --config train/configs/smollm2-eagle31.yaml --data train/data/sharegpt-regen.jsonl.gz

A drafter is judged by how often it predicts what the *target* says, so it
learns most from the target's own responses (self-distillation). For each
training conversation, assistant turn j is replaced by the target's greedy
continuation of the conversation so far (earlier turns already regenerated),
for up to `max_turns` exchanges; the conversation ends at the first turn that
hit `max_new_tokens` or would overflow `max_prompt_tokens`. Held-out
conversations (train/data.py `is_heldout`) are copied unchanged: only their
prompts are used, for evaluation, and keeping their ids keeps the split.

Output: JSONL, one `{"id", "messages", "regenerated_turns", "truncated"}` per
conversation, in input order, appended batch by batch and fsync'ed; a rerun
with the same arguments skips the ids already written (a torn last line from
a killed run is dropped), so the job resumes where it stopped. `skip_ids` (`--skip-ids-from`, e.g. the
committed train/data/sharegpt-regen.jsonl.gz) are skipped too, so a fresh working
file continues after what is already in git (train/datastore.py merges it back).
With progress off, one JSON line per batch goes to stderr (done, tokens, tok/s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["add_arguments", "main", "regenerate", "read_done"]


def read_done(path: Path) -> set[str]:
    """Ids already in `path`; a torn (unterminated or unparsable) last line is cut off."""
    if not path.is_file():
        return set()
    done, good = set(), 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                done.add(json.loads(line)["id"])
            except (ValueError, KeyError, TypeError):
                break
            good += len(line)
    if good != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


def _append(f, records: Iterable[dict]) -> None:
    for r in records:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


def _exchanges(messages: Sequence[dict]) -> tuple[list[dict], list[list[dict]]]:
    """Split into the leading system turns and the (user..., assistant) exchanges."""
    head, rest = [], list(messages)
    while rest and rest[0]["role"] == "system":
        head.append(rest.pop(0))
    ex, cur = [], []
    for m in rest:
        if m["role"] == "assistant":
            if cur:
                ex.append(cur)
            cur = []
        else:
            cur.append(m)
    return head, ex


def regenerate(conversations: Sequence[dict], generator, out_path: str | os.PathLike, *,
               batch_size: int = 16, max_new_tokens: int = 256, max_prompt_tokens: int = 512,
               max_turns: int = 1, heldout_fraction: float = 0.02, progress: bool = True,
               skip_ids: Iterable[str] = ()) -> dict:
    """Regenerate the assistant turns of `conversations` (see the module docstring).

    `generator` is an `eagle_jax.generate.Generator` (plain or speculative:
    greedy output is the target's either way). Returns counts and timings.
    """
    from tqdm import tqdm

    from eagle_jax.train.data import is_heldout

    if batch_size < 1 or max_new_tokens < 1 or max_turns < 1:
        raise ValueError("batch_size, max_new_tokens and max_turns must be >= 1")
    tok = generator.tokenizer
    if tok is None or not tok.chat_template:
        raise ValueError("regenerate needs a target tokenizer with a chat template")
    out_path = Path(out_path)
    if out_path.name.endswith(".gz"):
        raise ValueError(f"{out_path}: regenerate appends to a plain .jsonl working file; merge it into "
                         "a .jsonl.gz with `python -P -m eagle_jax.train.datastore merge`")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out_path) | set(skip_ids)
    todo = [c for c in conversations if c["id"] not in done]
    # One set of padded shapes for every batch: one compile.
    generator.min_shapes = (max_prompt_tokens, max_prompt_tokens + max_new_tokens + 2, max_new_tokens + 16)
    stats = {"skipped_already_done": len(conversations) - len(todo), "conversations": 0,
             "heldout_copied": 0, "no_answer_copied": 0, "dropped_prompt_too_long": 0, "turns": 0, "tokens": 0, "truncated": 0, "generate_s": 0.0}
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv", disable=not progress)
    with open(out_path, "a", encoding="utf-8") as f:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            records, live = [], {}  # live: index in records -> regeneration state
            for conv in chunk:
                head, ex = _exchanges(conv["messages"])
                heldout = is_heldout(conv["id"], heldout_fraction)
                if heldout or not ex:
                    records.append({"id": conv["id"], "messages": conv["messages"],
                                    "regenerated_turns": 0, "truncated": False})
                    stats["heldout_copied" if heldout else "no_answer_copied"] += 1
                else:
                    live[len(records)] = {"ex": ex, "open": True}
                    records.append({"id": conv["id"], "messages": list(head), "regenerated_turns": 0,
                                    "truncated": False})
            for turn in range(max_turns):
                rows, prompts = [], []
                for i, s in live.items():
                    if not s["open"] or turn >= len(s["ex"]):
                        continue
                    ids = tok.apply_chat(records[i]["messages"] + s["ex"][turn], add_generation_prompt=True)
                    if len(ids) > max_prompt_tokens:
                        s["open"] = False
                        continue
                    rows.append(i)
                    prompts.append(ids)
                if not rows:
                    break
                t0 = time.perf_counter()
                res = generator.generate(prompts, max_new_tokens=max_new_tokens, chat=False)
                stats["generate_s"] += time.perf_counter() - t0
                for i, text, reason, ids in zip(rows, res.texts, res.finish_reasons, res.token_ids):
                    r = records[i]
                    r["messages"] = r["messages"] + live[i]["ex"][turn] + [
                        {"role": "assistant", "content": text}]
                    r["regenerated_turns"] += 1
                    if reason != "eos":  # cut off: later turns would answer a different text
                        r["truncated"], live[i]["open"] = True, False
                    stats["turns"] += 1
                    stats["tokens"] += len(ids)
            # a conversation whose first prompt does not fit yields nothing
            kept = [r for i, r in enumerate(records) if i not in live or r["regenerated_turns"] > 0]
            stats["dropped_prompt_too_long"] += len(records) - len(kept)
            stats["conversations"] += sum(1 for i in live if records[i]["regenerated_turns"] > 0)
            stats["truncated"] += sum(1 for r in kept if r["truncated"])
            _append(f, kept)
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{stats['tokens'] / max(stats['generate_s'], 1e-9):.0f}")
            if not progress:
                print(json.dumps({"regenerate": min(start + batch_size, len(todo)), "of": len(todo),
                                  "tokens": stats["tokens"], "generate_s": round(stats["generate_s"], 1),
                                  "tok_s": round(stats["tokens"] / max(stats["generate_s"], 1e-9), 1),
                                  "time": time.strftime("%Y-%m-%dT%H:%M:%S")}),
                      file=sys.stderr, flush=True)
    bar.close()
    stats["tokens_per_s"] = stats["tokens"] / max(stats["generate_s"], 1e-9)
    return stats


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", required=True, help="JSONL to write (appended to; resumable)")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target name, HF dir, .gguf or hub id")
    p.add_argument("--data", default="sharegpt", help="'sharegpt' or a JSONL of conversations")
    p.add_argument("--max-conversations", type=int, default=400, help="conversations read (0 = all)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-turns", type=int, default=1, help="assistant turns regenerated per conversation")
    p.add_argument("--heldout-fraction", type=float, default=0.02, help="must match the training config")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--skip-ids-from", default=None, metavar="PATHS",
                   help="comma-separated .jsonl/.jsonl.gz files whose ids are skipped (e.g. the committed "
                        "train/data/sharegpt-regen.jsonl.gz)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=True)


def main(args) -> int:
    from eagle_jax.generate import Generator
    from eagle_jax.train.cli import read_conversations
    from eagle_jax.train.datastore import read_ids

    skip = read_ids(args.skip_ids_from) if args.skip_ids_from else set()
    convs = read_conversations(args.data, args.max_conversations or None)
    gen = Generator.load(args.target, draft=None, dtype=args.dtype)
    stats = regenerate(convs, gen, args.output, batch_size=args.batch_size,
                       max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                       max_turns=args.max_turns, heldout_fraction=args.heldout_fraction,
                       progress=args.progress, skip_ids=skip)
    print(json.dumps({"output": args.output, **stats}))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="eagle-jax regenerate")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
