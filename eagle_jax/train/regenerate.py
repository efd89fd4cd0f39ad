"""`eagle-jax regenerate`: rewrite assistant turns with the target itself.

    eagle-jax regenerate --output runs/data/sharegpt-regen.jsonl --max-conversations 400 \
        --skip-ids-from train/data/sharegpt-regen.jsonl.gz
    python -m eagle_jax.train.datastore merge runs/data/sharegpt-regen.jsonl train/data/sharegpt-regen.jsonl.gz
    eagle-jax train --config train/configs/smollm2-eagle31.yaml --data train/data/sharegpt-regen.jsonl.gz

A drafter is judged by how often it predicts what the *target* says, so it
learns most from the target's own responses (self-distillation). For each
training conversation, assistant turn j is replaced by the target's greedy
continuation of the conversation so far (earlier turns already regenerated),
for up to `max_turns` exchanges; the conversation ends at the first turn that
hit `max_new_tokens` or would overflow `max_prompt_tokens`. With
`--later-turns`, the prompts are instead each later user turn on its own
(`later_turns`: a conversation's turns after the first, which first-turn
regeneration never reaches). Held-out
conversations (train/data.py `is_heldout`) are copied unchanged: only their
prompts are used, for evaluation, and keeping their ids keeps the split.

The answers come from the engine the server runs (eagle_jax/engine/:
continuous batching): `batch_size` conversations at a time, each in its own
slot, a finished one's slot taken at once by the next conversation.

Output: JSONL, one `{"id", "messages", "regenerated_turns", "truncated"}` per
conversation, in the order they finish, each appended and fsync'ed; a rerun
with the same arguments skips the ids already written (a torn last line from
a killed run is dropped), so the job resumes where it stopped. `skip_ids` (`--skip-ids-from`, e.g. the
committed train/data/sharegpt-regen.jsonl.gz) are skipped too, so a fresh working
file continues after what is already in git (train/datastore.py merges it back).
With progress off, one JSON line per `batch_size` conversations goes to stderr
(done, tokens, tok/s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["add_arguments", "main", "regenerate", "read_done", "later_turns"]


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


def _exchanges(messages: Sequence[dict]) -> tuple[list[dict], list[tuple[list[dict], dict]]]:
    """Split into the leading system turns and the exchanges: (the turns before an
    assistant turn, that assistant turn); an assistant turn with no turn before it
    since the last answer, and turns after the last answer, belong to none."""
    head, rest = [], list(messages)
    while rest and rest[0]["role"] == "system":
        head.append(rest.pop(0))
    ex, cur = [], []
    for m in rest:
        if m["role"] == "assistant":
            if cur:
                ex.append((cur, m))
            cur = []
        else:
            cur.append(m)
    return head, ex


def later_turns(conversations: Iterable[dict], heldout_fraction: float = 0.02) -> list[dict]:
    """Each user turn after the first, as a one-exchange conversation of its own: the leading
    system turns, that user turn and the answer it had, with id ``"<id>#u<j>"`` (j = 1, 2, ...
    counts the exchanges). Held-out conversations give none: their prompts stay out of training."""
    from eagle_jax.train.data import is_heldout

    out = []
    for conv in conversations:
        if is_heldout(conv["id"], heldout_fraction):
            continue
        head, ex = _exchanges(conv["messages"])
        for j, (turn, answer) in enumerate(ex[1:], start=1):
            out.append({"id": f"{conv['id']}#u{j}", "messages": head + turn + [answer]})
    return out


def regenerate(conversations: Sequence[dict], generator, out_path: str | os.PathLike, *,
               batch_size: int = 16, max_new_tokens: int = 256, max_prompt_tokens: int = 512,
               max_turns: int = 1, heldout_fraction: float = 0.02, progress: bool = True,
               skip_ids: Iterable[str] = ()) -> dict:
    """Regenerate the assistant turns of `conversations` (see the module docstring).

    `generator` is an `eagle_jax.generate.Generator` (plain or speculative:
    greedy output is the target's either way). Returns counts and timings.
    """
    from eagle_jax.train.data import is_heldout

    if batch_size < 1 or max_new_tokens < 1 or max_turns < 1:
        raise ValueError("batch_size, max_new_tokens and max_turns must be >= 1")
    tok = generator.tokenizer
    if tok is None or not tok.chat_template:
        raise ValueError("regenerate needs a target tokenizer with a chat template")
    out_path = Path(out_path)
    if out_path.name.endswith(".gz"):
        raise ValueError(f"{out_path}: regenerate appends to a plain .jsonl working file; merge it into "
                         "a .jsonl.gz with `python -m eagle_jax.train.datastore merge`")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out_path) | set(skip_ids)
    todo = [c for c in conversations if c["id"] not in done]
    stats = {"skipped_already_done": len(conversations) - len(todo), "conversations": 0,
             "heldout_copied": 0, "no_answer_copied": 0, "dropped_prompt_too_long": 0, "turns": 0, "tokens": 0,
             "truncated": 0, "generate_s": 0.0}
    with open(out_path, "a", encoding="utf-8") as f:
        rest = []
        for conv in todo:  # copied as they are: held-out conversations and ones with no answer
            heldout = is_heldout(conv["id"], heldout_fraction)
            if heldout or not _exchanges(conv["messages"])[1]:
                _append(f, [{"id": conv["id"], "messages": conv["messages"], "regenerated_turns": 0,
                             "truncated": False}])
                stats["heldout_copied" if heldout else "no_answer_copied"] += 1
            else:
                rest.append(conv)
        if rest:
            _run(rest, generator, f, stats, batch_size=batch_size, max_new_tokens=max_new_tokens,
                 max_prompt_tokens=max_prompt_tokens, max_turns=max_turns, progress=progress, total=len(todo))
    stats["tokens_per_s"] = stats["tokens"] / max(stats["generate_s"], 1e-9)
    return stats


def _run(conversations, generator, f, stats: dict, *, batch_size, max_new_tokens, max_prompt_tokens, max_turns,
         progress, total) -> None:
    """Regenerate on the engine (eagle_jax/engine/: the server's continuous batching), one
    conversation per row at a time: its turns go in one after another, and a row whose
    conversation ends takes the next one. Records are appended as conversations finish."""
    import asyncio

    from tqdm import tqdm

    from eagle_jax.engine import Delta, Engine, Sampling, fitting_max_len

    tok = generator.tokenizer
    engine = Engine(generator, max_rows=batch_size,
                    max_len=fitting_max_len(generator, max_prompt_tokens, max_new_tokens))
    stats["warmup_s"] = round(engine.warmup_s, 1)
    bar = tqdm(total=total, initial=total - len(conversations), desc="regenerate", unit="conv",
               disable=not progress)

    async def answer(ids: list[int]) -> tuple[str, str, int]:
        """(text, finish reason, completion tokens) of one greedy answer."""
        text = ""
        async for event in engine.submit(ids, Sampling(max_new_tokens=max_new_tokens)).events():
            if isinstance(event, Delta):
                text += event.text
            else:
                return text, event.finish_reason, event.completion_tokens

    async def converse(conv: dict) -> dict | None:
        """The conversation with up to `max_turns` answers regenerated; None when its first prompt is too long."""
        head, ex = _exchanges(conv["messages"])
        rec = {"id": conv["id"], "messages": list(head), "regenerated_turns": 0, "truncated": False}
        for turn, _ in ex[:max_turns]:
            ids = tok.apply_chat(rec["messages"] + turn, add_generation_prompt=True)
            if len(ids) > max_prompt_tokens:
                break
            text, reason, n = await answer(ids)
            rec["messages"] = rec["messages"] + turn + [{"role": "assistant", "content": text}]
            rec["regenerated_turns"] += 1
            stats["turns"] += 1
            stats["tokens"] += n
            if reason != "eos":  # cut off: later turns would answer a different text
                rec["truncated"] = True
                break
        return rec if rec["regenerated_turns"] else None

    async def drive() -> None:
        todo = iter(conversations)
        t0 = time.perf_counter()
        finished = total - len(conversations)

        async def row_worker():
            nonlocal finished
            for conv in todo:  # one iterator shared by every worker
                rec = await converse(conv)
                if rec is None:
                    stats["dropped_prompt_too_long"] += 1
                else:
                    _append(f, [rec])
                    stats["conversations"] += 1
                    stats["truncated"] += rec["truncated"]
                stats["generate_s"] = time.perf_counter() - t0
                finished += 1
                bar.update(1)
                bar.set_postfix(tok_s=f"{stats['tokens'] / max(stats['generate_s'], 1e-9):.0f}")
                if not progress and (finished % batch_size == 0 or finished == total):
                    print(json.dumps({"regenerate": finished, "of": total, "tokens": stats["tokens"],
                                      "generate_s": round(stats["generate_s"], 1),
                                      "tok_s": round(stats["tokens"] / max(stats["generate_s"], 1e-9), 1),
                                      "time": time.strftime("%Y-%m-%dT%H:%M:%S")}), file=sys.stderr, flush=True)

        await asyncio.gather(*(row_worker() for _ in range(batch_size)))

    try:
        asyncio.run(drive())
    finally:
        engine.close()
        bar.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", required=True, help="JSONL to write (appended to; resumable)")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target name, HF dir, .gguf or hub id")
    p.add_argument("--data", default="sharegpt", help="'sharegpt' or a JSONL of conversations")
    p.add_argument("--max-conversations", type=int, default=400, help="conversations read (0 = all)")
    p.add_argument("--batch-size", type=int, default=16, help="conversations regenerated at a time (engine rows)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-turns", type=int, default=1, help="assistant turns regenerated per conversation")
    p.add_argument("--later-turns", action="store_true",
                   help="prompts from each user turn after the first, alone (ids '<id>#u<j>'; none from "
                        "held-out conversations), rather than from the conversations' first turns")
    p.add_argument("--heldout-fraction", type=float, default=0.02, help="must match the training config")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--skip-ids-from", default=None, metavar="PATHS",
                   help="comma-separated .jsonl/.jsonl.gz files whose ids are skipped (e.g. the committed "
                        "train/data/sharegpt-regen.jsonl.gz)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=True)


def main(args) -> int:
    from eagle_jax.generate import Generator
    from eagle_jax.train.datastore import read_conversations
    from eagle_jax.train.datastore import read_ids

    skip = read_ids(args.skip_ids_from) if args.skip_ids_from else set()
    convs = read_conversations(args.data, args.max_conversations or None)
    if args.later_turns:
        convs = later_turns(convs, args.heldout_fraction)
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
