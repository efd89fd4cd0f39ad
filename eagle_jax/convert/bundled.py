"""Drafters shipped inside the package (eagle_jax/drafters/<name>/, speculators format).

A name resolves to a directory; `"default"` picks the bundled drafter
registered for the target: by the target's built-in name, or by the HF id the
loaded target reports (`TargetConfig.name_or_path`, so a local copy of the same
model matches too). When none is registered the choice is plain decoding, and
that is logged with the reason (logger `eagle_jax.convert`), as is the drafter
chosen.
"""

from __future__ import annotations

import logging
import os

from eagle_jax.convert.registry import BUILTIN_TARGETS

_HERE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "drafters")
log = logging.getLogger("eagle_jax.convert")

# name -> (folder, targets it was trained for)
BUNDLED_DRAFTERS = {
    "smollm2-135m-eagle3.1": ("smollm2-135m-eagle3.1", ("smollm2-135m-instruct",)),
    "smollm2-135m-eagle3": ("smollm2-135m-eagle3", ("smollm2-135m-instruct",)),
}
DEFAULT_FOR_TARGET = {"smollm2-135m-instruct": "smollm2-135m-eagle3.1"}


def bundled_path(name: str) -> str | None:
    """Directory of a bundled drafter, or None when it is not shipped in this install."""
    if name not in BUNDLED_DRAFTERS:
        return None
    path = os.path.join(_HERE, BUNDLED_DRAFTERS[name][0])
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def default_drafter_name(target_name: str, target_cfg=None) -> tuple[str | None, str]:
    """(bundled drafter name or None, why) for `--draft default`."""
    by_hf_id = {BUILTIN_TARGETS.get(t, t).lower(): d for t, d in DEFAULT_FOR_TARGET.items()}
    hf_id = getattr(target_cfg, "name_or_path", "") or ""
    if target_name.lower() in DEFAULT_FOR_TARGET:
        name = DEFAULT_FOR_TARGET[target_name.lower()]
        return name, f"registered for target {target_name!r}"
    if hf_id.lower() in by_hf_id:
        return by_hf_id[hf_id.lower()], f"registered for {hf_id!r}, the model target {target_name!r} reports"
    known = ", ".join(f"{t} ({BUILTIN_TARGETS.get(t, t)})" for t in DEFAULT_FOR_TARGET)
    return None, (f"no bundled drafter is registered for target {target_name!r}"
                  f"{f' ({hf_id})' if hf_id and hf_id != target_name else ''}; defaults exist for "
                  f"{known}; decoding without speculation (pass --draft DIR for a drafter)")


def resolve_drafter(draft: str | None, target_name: str, target_cfg=None) -> str | None:
    """Map a --draft value to a checkpoint directory (None = plain decoding)."""
    if draft is None or draft == "none":
        return None
    if draft == "default":
        name, why = default_drafter_name(target_name, target_cfg)
        path = bundled_path(name) if name else None
        if name and path is None:
            why = f"bundled drafter {name!r} ({why}) is not shipped in this installation"
        log.info("--draft default: %s", f"{name} ({why})" if path else why)
        return path
    if draft in BUNDLED_DRAFTERS:
        path = bundled_path(draft)
        if path is None:
            raise FileNotFoundError(f"bundled drafter {draft!r} is not shipped in this installation")
        return path
    if os.path.isdir(draft):
        return draft
    raise FileNotFoundError(f"drafter {draft!r} is neither a bundled name "
                            f"({', '.join(BUNDLED_DRAFTERS)}), 'default', 'none' nor a directory")


def load_drafter_by_name(draft: str | None, target_cfg, target_name: str, dtype="float32", *, mesh=None):
    """(DrafterConfig, params, DraftVocab) for a --draft value, or None; with a jax `mesh`,
    read straight into its shards."""
    path = resolve_drafter(draft, target_name, target_cfg)
    if path is None:
        return None
    from eagle_jax.convert.drafter_formats import load_drafter

    return load_drafter(path, target_cfg=target_cfg, dtype=dtype, mesh=mesh)
