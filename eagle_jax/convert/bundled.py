"""Drafters shipped inside the package (eagle_jax/drafters/<name>/, speculators format).

A name resolves to a directory; `"default"` picks the bundled drafter
registered for a target source (today: the EAGLE 3.1 drafter for
SmolLM2-135M-Instruct) or none when the target has no bundled drafter.
"""

from __future__ import annotations

import os

_HERE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "drafters")

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


def resolve_drafter(draft: str | None, target_name: str) -> str | None:
    """Map a --draft value to a checkpoint directory (None = plain decoding)."""
    if draft is None or draft == "none":
        return None
    if draft == "default":
        name = DEFAULT_FOR_TARGET.get(target_name)
        return bundled_path(name) if name else None
    if draft in BUNDLED_DRAFTERS:
        path = bundled_path(draft)
        if path is None:
            raise FileNotFoundError(f"bundled drafter {draft!r} is not shipped in this installation")
        return path
    if os.path.isdir(draft):
        return draft
    raise FileNotFoundError(f"drafter {draft!r} is neither a bundled name "
                            f"({', '.join(BUNDLED_DRAFTERS)}), 'default', 'none' nor a directory")


def load_drafter_by_name(draft: str | None, target_cfg, target_name: str, dtype="float32"):
    """(DrafterConfig, params, DraftVocab) for a --draft value, or None."""
    path = resolve_drafter(draft, target_name)
    if path is None:
        return None
    from eagle_jax.convert.drafter_formats import load_drafter

    return load_drafter(path, target_cfg=target_cfg, dtype=dtype)
