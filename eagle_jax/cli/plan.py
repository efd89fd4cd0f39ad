"""`eagle-jax plan`: per-device bytes of serving a target and drafter on a mesh (eagle_jax/plan.py),
or with `--train` of training a drafter for the target there (eagle_jax/train/plan.py).

    eagle-jax plan --target llama-3.1-8b-instruct --draft eagle3-llama-3.1-8b-instruct --mesh 1x8
    eagle-jax plan --train --target llama-3.1-8b-instruct --variant eagle3.1 --mesh 1x8 --seq-len 2048
"""

from __future__ import annotations

import argparse
import json

from eagle_jax.config import ConfigError
from eagle_jax.plan import GIB, MLADrafterTensors, plan, resolve_config
from eagle_jax.sharding import parse_mesh

__all__ = ["add_arguments", "main"]

# Flags of one mode only: given in the other, they are an error, not ignored.
_SERVE_ONLY = ("draft", "context", "verify_tokens")
_TRAIN_ONLY = ("config", "variant", "draft_vocab_size", "seq_len", "ttt_length", "param_dtype", "target_dtype",
               "fsdp", "overrides")


def add_arguments(p) -> None:
    p.add_argument("--target", required=True,
                   help="config.json, a directory with one, or a shipped name (e.g. llama-3.1-8b-instruct)")
    p.add_argument("--mesh", default="1x1", help="DATAxMODEL devices (e.g. 1x8: tensor parallel over 8)")
    p.add_argument("--batch", type=int, default=None,
                   help="rows decoded together (default 1); with --train, rows a step (the training config's)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="weights and compute (default bfloat16); with --train the compute dtype of the target "
                        "pass and the drafter, the target's weights in it (the training config's)")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="memory of one device (e.g. 16 for a TPU v5e chip, 80 for an H100): say whether it fits")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    serve = p.add_argument_group("serving (without --train)")
    serve.add_argument("--draft", default=None,
                       help="the drafter's config.json, directory or shipped name (e.g. "
                            "eagle3-llama-3.1-8b-instruct), or none (the default)")
    serve.add_argument("--context", type=int, default=None, help="cache slots a row, prompt and answer (4096)")
    serve.add_argument("--verify-tokens", type=int, default=None,
                       help="tokens a row in one verify step (a tree's total tokens; chain k: k + 1; 16)")
    train = p.add_argument_group("training a drafter (--train): the run `eagle-jax train` makes of these settings")
    train.add_argument("--train", action="store_true", help="plan a drafter training run instead of serving")
    train.add_argument("--config", default=None, help="a training config (YAML or JSON of TrainConfig keys)")
    train.add_argument("--variant", choices=("eagle3", "eagle3.1"), default=None)
    train.add_argument("--draft-vocab-size", type=int, default=None)
    train.add_argument("--seq-len", type=int, default=None, help="tokens a row")
    train.add_argument("--ttt-length", type=int, default=None, help="training-time-test steps")
    train.add_argument("--param-dtype", choices=("float32", "bfloat16"), default=None,
                       help="the trained weights and Adam's moments (float32)")
    train.add_argument("--target-dtype", choices=("float32", "bfloat16"), default=None,
                       help="the target pass alone (a second copy of the target in it)")
    train.add_argument("--fsdp", action="store_true", default=None,
                       help="the drafter and its optimizer state split over the data axis (else replicated)")
    train.add_argument("--set", dest="overrides", action="append", default=None, metavar="KEY=VALUE",
                       help="any other TrainConfig key (repeatable)")


def _refuse(args, names: tuple[str, ...], why: str) -> None:
    given = [n for n in names if getattr(args, n) is not None]
    if given:
        flags = ", ".join("--" + ("set" if n == "overrides" else n.replace("_", "-")) for n in given)
        raise ConfigError(f"{flags}: {why}")


def _train_config(args):
    """The TrainConfig `eagle-jax train` would run with these flags (train/cli.py `load_config`)."""
    from eagle_jax.train.cli import load_config

    sets = list(args.overrides or [])
    sets += [f"{k}={getattr(args, k)}" for k in ("param_dtype", "target_dtype") if getattr(args, k)]
    return load_config(argparse.Namespace(
        config=args.config, target=args.target, mesh=args.mesh, batch_size=args.batch, dtype=args.dtype,
        fsdp=args.fsdp, variant=args.variant, draft_vocab_size=args.draft_vocab_size, seq_len=args.seq_len,
        ttt_length=args.ttt_length, overrides=sets))


def _plan_train(args) -> tuple[dict, str]:
    from eagle_jax.convert.hf import target_config_from_hf
    from eagle_jax.train.plan import plan_train

    _refuse(args, _SERVE_ONLY, "serving flags; --train builds its drafter as `eagle-jax train` does "
                               "(--variant, --draft-vocab-size, --config)")
    cfg = _train_config(args)
    out = plan_train(target_config_from_hf(resolve_config(args.target), args.target), cfg)
    head = (f"training an {out['variant']} drafter (draft vocabulary {out['draft_vocab_size']}) for {args.target}, "
            f"mesh {out['mesh']} (data x model, {out['devices']} devices), batch {out['batch']} x {out['seq_len']} "
            f"tokens, {out['ttt_length']} TTT steps, compute {out['dtype']} (target {out['target_dtype']}), "
            f"params {out['param_dtype']} {'split over data (FSDP)' if out['fsdp'] else 'replicated'}")
    return out, head


def _plan_serve(args) -> tuple[dict, str]:
    from eagle_jax.convert.drafter_config import drafter_config_from_dict
    from eagle_jax.convert.hf import target_config_from_hf

    _refuse(args, _TRAIN_ONLY, "training flags: give --train")
    target_cfg = target_config_from_hf(resolve_config(args.target), args.target)
    draft = args.draft or "none"
    drafter_cfg = None
    if draft != "none":
        d = resolve_config(draft)
        # an MLA drafter (kv_lora_rank): counted as vLLM's tensors (`plan.MLADrafterTensors`)
        drafter_cfg = (MLADrafterTensors.from_dict(d, target_cfg) if d.get("kv_lora_rank") is not None
                       else drafter_config_from_dict(d, target_cfg))
    batch, context = args.batch or 1, args.context or 4096
    verify, dtype = args.verify_tokens or 16, args.dtype or "bfloat16"
    out = plan(target_cfg, drafter_cfg, parse_mesh(args.mesh), batch=batch, context=context, verify_tokens=verify,
               dtype=dtype)
    head = (f"target {args.target}, drafter {draft}, mesh {out['mesh']} (data x model, {out['devices']} devices), "
            f"batch {batch}, context {context}, {verify} verify tokens a row, {dtype}")
    return out, head


def main(args) -> int:
    out, head = (_plan_train if args.train else _plan_serve)(args)
    if args.device_memory_gib is not None:
        out["device_memory_gib"] = args.device_memory_gib
        out["fits"] = out["total_per_device"] <= args.device_memory_gib * GIB
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    estimates = set(out.get("estimates", ()))
    print(head)
    print("per device:")
    for name, b in out["bytes_per_device"].items():
        print(f"  {name:<26}{b / GIB:>10.3f} GiB{'  (estimate)' if name in estimates else ''}")
    rule = ("exact terms + the larger estimate: the passes run one after the other" if args.train
            else "weights, caches and features + the larger activations")
    print(f"  {'total':<26}{out['total_per_device'] / GIB:>10.3f} GiB  ({rule})")
    if "fits" in out:
        verdict = "fits" if out["fits"] else "does NOT fit"
        print(f"  {verdict} in {args.device_memory_gib:g} GiB "
              f"({100 * out['total_per_device'] / (args.device_memory_gib * GIB):.0f}% of it)")
    for note in out["notes"]:
        print(f"note: {note}")
    return 0
