"""The flags that model-loading subcommands share (generate, serve, bench): the target,
drafter, dtype, speculation and mesh flags, and the Generator they describe."""

from __future__ import annotations

import argparse

from eagle_jax.config import ConfigError, SpecConfig
from eagle_jax.sharding import parse_mesh

__all__ = ["MAX_CHAIN_TOKENS", "add_model_arguments", "add_aux_semantics_argument", "add_disable_by_batch_size",
           "add_multihost_arguments", "join_processes", "spec_from_args", "generator_from_args"]

# A chain of k drafted tokens compiles k drafter steps and verifies k + 1 tokens; past 16 the
# compile time runs into minutes while a drafter accepts a few tokens per step at best.
MAX_CHAIN_TOKENS = 16


def add_multihost_arguments(p: argparse.ArgumentParser, lead: str) -> None:
    """--coordinator-address, --num-processes, --process-id (generate and serve); `lead`: what
    process 0 does that the others do not."""
    multi = p.add_argument_group("multi-host", "run the same command in every process, one per host, with "
                                 f"--mesh spanning all their devices; {lead}")
    multi.add_argument("--coordinator-address", default=None, help="HOST:PORT of process 0")
    multi.add_argument("--num-processes", type=int, default=1)
    multi.add_argument("--process-id", type=int, default=0)


def join_processes(args, mesh: str | None) -> bool:
    """Join the other processes when --num-processes > 1 (before anything starts JAX's
    backends), for a run on `mesh`; whether this one is process 0."""
    if args.num_processes == 1:
        return True
    if args.coordinator_address is None or mesh is None:
        raise ValueError("--num-processes > 1 needs --coordinator-address and a --mesh over every process's devices")
    from eagle_jax.runtime import initialize_distributed

    initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    return args.process_id == 0


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Target, drafter, dtype and speculation flags (generate and serve)."""
    p.add_argument("--target", default="smollm2-135m-instruct", help="target name, HF dir, .gguf or hub id")
    p.add_argument("--draft", default="default",
                   help="drafter dir or bundled name; 'default' = bundled drafter of the target; 'none' = plain")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 (f32 accumulation) on GPU/TPU and on CPU when the native kernels run, "
                        "else float32")
    p.add_argument("--method", choices=["chain", "tree"], default=SpecConfig.method)
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help=f"chain length k, 1..{MAX_CHAIN_TOKENS} (default {SpecConfig.num_speculative_tokens}; "
                        "chain only: a tree is sized by the --tree-* flags)")
    p.add_argument("--tree-top-k", type=int, default=SpecConfig.tree_top_k)
    p.add_argument("--tree-depth", type=int, default=SpecConfig.tree_depth)
    p.add_argument("--tree-total-tokens", type=int, default=SpecConfig.tree_total_tokens)
    p.add_argument("--mesh", default=None,
                   help="DATAxMODEL (e.g. 1x8): shard over the first DATA*MODEL devices by eagle_jax/sharding.py's "
                        "rules, decoding through XLA, the Pallas kernels on each device's block (on CPU, simulate "
                        "devices with XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    add_disable_by_batch_size(p)
    add_aux_semantics_argument(p)


def add_aux_semantics_argument(p: argparse.ArgumentParser) -> None:
    """--aux-layer-semantics: how the drafter's aux layer ids are read (generate, serve, convert)."""
    p.add_argument("--aux-layer-semantics", type=str.lower, default=None,
                   help="read the drafter's aux layer ids as outputs of layers (sglang, specforge, "
                        "output: +1) or as inputs (vllm, safeailab, speculators, input); default: "
                        "the rule for the config's publisher (README, Drafters)")


def _batch_limit(s: str) -> int | str | None:
    s = s.strip().lower()
    if s in ("auto", "none"):
        return None if s == "none" else s
    if not s.isdigit() or int(s) < 1:
        raise argparse.ArgumentTypeError(f"expected a batch size >= 1, 'none' or 'auto', got {s!r}")
    return int(s)


def add_disable_by_batch_size(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disable-by-batch-size", type=_batch_limit, default="auto", metavar="N|none|auto",
                   help="batches of more than N rows decode without speculation (same output); "
                        "none: always speculate; auto (default): none on GPU/TPU, on CPU 4 with AMX tiles (bf16), "
                        "1 with AVX-512 (none for the server's adaptive engine: its draft policy measures "
                        "what pays), else never")


def spec_from_args(args) -> SpecConfig:
    """The SpecConfig of the flags; a flag the method does not use, or a chain past
    MAX_CHAIN_TOKENS, is an error rather than silently ignored."""
    k = args.num_speculative_tokens
    if args.method == "tree" and k is not None:
        raise ConfigError("--num-speculative-tokens sizes a chain; with --method tree use --tree-top-k, "
                          "--tree-depth and --tree-total-tokens (or --draft none for plain decoding)")
    if k is not None and not 1 <= k <= MAX_CHAIN_TOKENS:
        raise ConfigError(f"--num-speculative-tokens must be in [1, {MAX_CHAIN_TOKENS}], got {k}"
                          + (" (--draft none decodes without speculation)" if k == 0 else ""))
    return SpecConfig(method=args.method,
                      num_speculative_tokens=SpecConfig.num_speculative_tokens if k is None else k,
                      tree_top_k=args.tree_top_k, tree_depth=args.tree_depth,
                      tree_total_tokens=args.tree_total_tokens,
                      disable_by_batch_size=args.disable_by_batch_size)


def generator_from_args(args):
    """The Generator that `add_model_arguments` flags describe."""
    from eagle_jax.convert.drafter_config import aux_layer_semantics_override
    from eagle_jax.generate import Generator

    spec = spec_from_args(args)
    with aux_layer_semantics_override(args.aux_layer_semantics):
        return Generator.load(args.target, draft=args.draft, dtype=args.dtype, spec=spec,
                              mesh=parse_mesh(args.mesh) if args.mesh else None)
