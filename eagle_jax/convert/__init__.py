"""Checkpoint converters: HF safetensors and GGUF targets, the converted-format cache.

Drafter checkpoint formats live in `eagle_jax.convert.drafter_formats`.
"""

from eagle_jax.convert.hf import (
    CheckpointError,
    load_hf_directory,
    rope_config_from_hf,
    target_config_from_hf,
)
from eagle_jax.convert.gguf import load_gguf
from eagle_jax.convert.registry import (
    BUILTIN_TARGETS,
    LoadedTarget,
    ModelNotFoundError,
    load_converted,
    load_target,
    save_converted,
    smollm2_gguf_path,
)

__all__ = [
    "BUILTIN_TARGETS",
    "CheckpointError",
    "LoadedTarget",
    "ModelNotFoundError",
    "load_converted",
    "load_gguf",
    "load_hf_directory",
    "load_target",
    "rope_config_from_hf",
    "save_converted",
    "smollm2_gguf_path",
    "target_config_from_hf",
]
