"""The drafters a benchmark suite compares: bundled, named on the command line, or
untrained (random-init, built as the trainer initialises one)."""

from __future__ import annotations

import os

__all__ = ["variant_name", "random_drafter", "resolve_drafters"]


def variant_name(cfg) -> str:
    return "EAGLE 3.1" if cfg.is_eagle31 else "EAGLE-3"


def random_drafter(variant: str, target, seed: int = 0):
    """(cfg, params, vocab) of an untrained drafter built the way the trainer initialises one."""
    import jax
    import jax.numpy as jnp

    from eagle_jax.models.drafter import DraftVocab
    from eagle_jax.train.config import TrainConfig
    from eagle_jax.train.initialize import build_drafter_config, init_drafter_params

    dcfg = build_drafter_config(target.cfg, TrainConfig(variant=variant))
    vocab = DraftVocab.from_target_ids(jnp.arange(dcfg.draft_vocab_size), target.cfg.vocab_size)
    params = init_drafter_params(dcfg, target.cfg, target.params, vocab, jax.random.PRNGKey(seed))
    dtype = target.params["embed"].dtype
    params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    return dcfg, params, vocab


def resolve_drafters(args, target, target_name: str, log) -> tuple[list[dict], list[str]]:
    """[{tag, label, variant, path, random_init, bundle: (cfg, params, vocab)}], notes."""
    from eagle_jax.convert.bundled import BUNDLED_DRAFTERS, bundled_path, load_drafter_by_name

    dtype = str(target.params["embed"].dtype)
    out, notes = [], []
    names = list(args.draft)
    if not names and not args.no_bundled:
        names = [n for n in ("smollm2-135m-eagle3", "smollm2-135m-eagle3.1")
                 if n in BUNDLED_DRAFTERS and bundled_path(n)]
        if not names:
            notes.append("no trained drafter found (no --draft given and no bundled drafter is shipped "
                         "in eagle_jax/drafters/): speculative decoding with a trained drafter was not run")
    for name in names:
        bundle = load_drafter_by_name(name, target.cfg, target_name, dtype=dtype)
        cfg = bundle[0]
        tag = name if name in BUNDLED_DRAFTERS else os.path.basename(os.path.normpath(name))
        tag = tag.replace("smollm2-135m-", "")
        path = bundled_path(name) if name in BUNDLED_DRAFTERS else os.path.abspath(name)
        out.append({"tag": tag, "label": f"{variant_name(cfg)} ({tag})", "variant": variant_name(cfg),
                    "path": path, "random_init": False, "bundle": bundle})
    if args.random_drafter:
        variants = ["eagle3", "eagle3.1"] if args.random_drafter == "both" else [args.random_drafter]
        for v in variants:
            bundle = random_drafter(v, target, seed=args.seed)
            out.append({"tag": f"random-{v}", "label": f"random-init {variant_name(bundle[0])} (UNTRAINED)",
                        "variant": variant_name(bundle[0]), "path": None, "random_init": True,
                        "bundle": bundle})
        notes.append("random-init drafters are untrained: they exercise the speculative machinery "
                     "(compile, draft, verify, accept) and their speedups are not a measure of EAGLE")
    for n in notes:
        log(n)
    return out, notes
