"""`eagle-jax` command line: generate | convert | train | regenerate | bench | serve | plan.

The subcommands other than generate and convert live beside what they run (train/cli.py,
serve/cli.py, benchmarks/cli.py, ...) and are imported by name when the parser is built;
the flags they share are in cli/args.py, which imports none of them."""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys

from eagle_jax.cli.args import (add_aux_semantics_argument, add_model_arguments, add_multihost_arguments,
                                generator_from_args, join_processes)
from eagle_jax.config import ConfigError


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text (speculative when a drafter is given)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts-file", help="JSONL file: one {\"prompt\": ...} (or a JSON string) per line")
    p.add_argument("--chat", dest="chat", action="store_true", default=True, help="apply the chat template (default)")
    p.add_argument("--no-chat", dest="chat", action="store_false")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--repeat", type=int, default=0,
                   help="run the request N more times; report compile_s and the repeats' median tokens/s")
    p.add_argument("--stream", action="store_true", help="print text as it is accepted (single prompt)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_arguments(p)
    add_multihost_arguments(p, "process 0 prints the result")
    p.set_defaults(func=_generate)


def _read_prompts(path: str) -> list[str]:
    """The prompts of a JSONL file; a bad line is an error naming the file and the line."""
    if os.path.isdir(path):
        raise ValueError(f"--prompts-file {path} is a directory, not a JSONL file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"cannot read --prompts-file {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text") from None
    prompts = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON value ({e.msg}, column {e.colno})") from None
        if isinstance(item, dict):
            if "prompt" not in item:
                raise ValueError(f"{path}:{n}: object has no 'prompt' key")
            item = item["prompt"]
        if not isinstance(item, str):
            raise ValueError(f"{path}:{n}: expected a string prompt")
        prompts.append(item)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _generate(args) -> int:
    prompts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompts_file)
    lead = join_processes(args, args.mesh)  # the other processes do the same work; process 0 speaks for all
    say = print if lead else (lambda *a, **kw: None)
    gen = generator_from_args(args)
    spec = gen.spec
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, chat=args.chat, stop=args.stop)
    if args.stream:
        if len(prompts) != 1:
            raise ValueError("--stream takes a single --prompt")
        for piece in gen.stream(prompts[0], **kw):
            say(piece, end="", flush=True)
        say()
        return 0
    runs = [gen.generate(prompts, **kw) for _ in range(1 + max(args.repeat, 0))]
    r = runs[0]
    spec_on = gen.speculates(len(prompts))
    if gen.speculative and not spec_on:
        why = (f"a batch of {len(prompts)} prompts is over --disable-by-batch-size ({gen.disable_by_batch_size})"
               if gen.disable_by_batch_size else "on this CPU (no AVX-512, or no native kernels) a verify step "
               "costs about twice a decode step, so --disable-by-batch-size auto turns speculation off")
        say(f"eagle-jax: {why}: decoding without speculation, the same output "
              f"(--disable-by-batch-size none speculates anyway)", file=sys.stderr)
    out = {
        "text": r.texts[0] if len(r.texts) == 1 else r.texts,
        "token_ids": r.token_ids[0] if len(r.token_ids) == 1 else r.token_ids,
        "num_generated": r.num_generated,
        "prompt_tokens": r.prompt_tokens[0] if len(r.prompt_tokens) == 1 else r.prompt_tokens,
        "finish_reason": r.finish_reasons[0] if len(r.finish_reasons) == 1 else r.finish_reasons,
        "wall_s": r.wall_s,
        "tokens_per_s": r.tokens_per_s,
        "ttft_s": r.ttft_s,
        "draft": "none" if not gen.speculative else args.draft,
        "method": spec.method if spec_on else "plain",
    }
    if spec_on:
        out.update({k: r.stats[k] for k in ("acceptance_length", "per_position_acceptance",
                                            "num_verify_steps", "draft_acceptance_rate",
                                            "accepted_histogram")})
    if len(runs) > 1:
        rest = runs[1:]
        out["compile_s"] = r.wall_s - statistics.median(x.wall_s for x in rest)
        out["tokens_per_s"] = statistics.median(x.tokens_per_s for x in rest)
        out["wall_s"] = statistics.median(x.wall_s for x in rest)
        out["ttft_s"] = statistics.median(x.ttft_s for x in rest)
        out["first_run_wall_s"] = r.wall_s
    if args.json:
        say(json.dumps(out))
    else:
        for text in r.texts:
            say(text)
        extra = f", tau {out['acceptance_length']:.2f}" if spec_on and out.get("acceptance_length") else ""
        say(f"[{out['num_generated']} tokens, {out['tokens_per_s']:.1f} tok/s{extra}]", file=sys.stderr)
    return 0


def _add_convert(sub):
    p = sub.add_parser("convert", help="convert checkpoints (targets and drafters, both directions)")
    p.add_argument("source", help="input: HF dir, .gguf, hub id, or a drafter dir")
    p.add_argument("output", help="output directory")
    p.add_argument("--kind", choices=["target", "drafter"], default=None,
                   help="default: drafter when the source config looks like an EAGLE drafter")
    p.add_argument("--format", choices=["speculators", "native", "eagle-jax"], default=None,
                   help="drafter output: speculators (vLLM) or native (SafeAILab); target output: eagle-jax")
    p.add_argument("--target", default=None, help="target the drafter belongs to (for defaults and verifier name)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    add_aux_semantics_argument(p)
    p.set_defaults(func=_convert)


def _convert(args) -> int:
    from eagle_jax.convert.convert_cli import run_convert
    from eagle_jax.convert.drafter_config import aux_layer_semantics_override

    with aux_layer_semantics_override(args.aux_layer_semantics):
        print(json.dumps(run_convert(args)))
    return 0


def _optional(sub, name: str, module: str, help_text: str):
    """Register a subcommand implemented in another module (train, bench, serve)."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("eagle_jax"):
            return
        raise
    p = sub.add_parser(name, help=help_text)
    mod.add_arguments(p)
    p.set_defaults(func=mod.main)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_convert(sub)
    _optional(sub, "train", "eagle_jax.train.cli", "train an EAGLE-3 / 3.1 drafter")
    _optional(sub, "regenerate", "eagle_jax.train.regenerate",
              "rewrite assistant turns with the target (self-distillation data for train)")
    _optional(sub, "bench", "eagle_jax.benchmarks.cli", "benchmarks and the evaluation report")
    _optional(sub, "serve", "eagle_jax.serve.cli", "HTTP server around the Generator")
    _optional(sub, "plan", "eagle_jax.cli.plan",
              "per-device memory of serving (with --train: training a drafter) on a mesh")
    return parser


class _StderrHandler(logging.StreamHandler):
    """A log handler writing to whatever `sys.stderr` is at the time of the record."""

    stream = property(lambda self: sys.stderr, lambda self, _: None)


_LOADER_LOG = _StderrHandler()
_LOADER_LOG.setFormatter(logging.Formatter("eagle-jax: %(message)s"))


def _log_loader_choices() -> None:
    """Show on stderr what the loaders chose (drafter, aux id reading): logger eagle_jax.convert."""
    logger = logging.getLogger("eagle_jax.convert")
    if _LOADER_LOG not in logger.handlers:
        logger.addHandler(_LOADER_LOG)
    logger.setLevel(logging.INFO)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _log_loader_choices()
    try:
        return args.func(args) or 0
    except (ConfigError, ValueError, FileNotFoundError, KeyError) as e:
        print(f"eagle-jax {args.command}: error: {e}", file=sys.stderr)
        return 2

