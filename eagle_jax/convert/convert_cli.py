"""`eagle-jax convert SOURCE OUTPUT`: targets to the converted format, drafters between formats.

* **Targets** (an HF directory, a `.gguf` file, a built-in name, a hub id or
  an already converted directory) are written in eagle-jax's fast-loading
  converted format (`registry.save_converted`: our parameter layout as one
  safetensors file, our config JSON, the tokenizer files). `--format` may only
  be `eagle-jax` for a target. `--dtype` casts the parameters; the default is
  the checkpoint's `torch_dtype` for an HF directory (float32 when it has none
  or names an unsupported one), float32 for GGUF (dequantised) and the stored
  dtype for a converted directory.
* **Drafters** (SafeAILab native, SpecForge or speculators checkpoint
  directories) are written in the speculators format (default; what vLLM
  serves by path) or the SafeAILab native format (`drafter_formats.save_drafter`).
  `--target` names the target the drafter belongs to: its config fills what
  the drafter config omits (aux layer ids, RoPE, context length), is checked
  against the drafter (vocabulary, hidden size) and becomes the verifier
  recorded in the output. `--dtype` casts the floats (default: as stored).

Without `--kind`, a source directory whose `config.json` looks like an EAGLE
drafter (`drafter_config.is_drafter_config`) is a drafter, anything else a
target. The output must not exist or be an empty directory.

`run_convert(args)` returns a JSON-able summary; errors are `ConvertError`
(a ValueError) or the loaders' own ConfigError / FileNotFoundError, which the
CLI reports on one line with exit status 2.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from eagle_jax.config import ConfigError, TargetConfig

__all__ = ["ConvertError", "run_convert", "detect_kind", "convert_target", "convert_drafter"]

TARGET_FORMATS = ("eagle-jax",)
DRAFTER_FORMATS = ("speculators", "native")
_DTYPES = ("float32", "bfloat16", "float16")


class ConvertError(ValueError):
    """The convert request cannot be carried out (bad source, format or output)."""


# ----------------------------------------------------------------------------- helpers


def _read_config(path: str) -> dict | None:
    """The parsed config.json of a directory source, None when there is none."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from None


def detect_kind(source: str) -> str:
    """'drafter' when `source` is a directory whose config.json looks like an EAGLE drafter."""
    from eagle_jax.convert.drafter_config import is_drafter_config

    path = os.path.expanduser(source)
    if os.path.isdir(path):
        config = _read_config(path)
        if config is not None and is_drafter_config(config):
            return "drafter"
    return "target"


def _check_output(output: str) -> str:
    out = os.path.abspath(os.path.expanduser(output))
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise ConvertError(f"output {out} exists and is a file; give a new directory")
        if os.listdir(out):
            raise ConvertError(f"output directory {out} exists and is not empty; refusing to "
                               "overwrite it (remove it or give a new directory)")
    return out


def _dir_summary(path: str) -> tuple[dict[str, int], int]:
    files = {}
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            files[str(p.relative_to(path))] = p.stat().st_size
    return files, sum(files.values())


def _num_params(tree) -> int:
    import numpy as np

    if isinstance(tree, dict):
        return sum(_num_params(v) for v in tree.values())
    return int(np.prod(tree.shape))


def _default_target_dtype(source: str) -> str:
    """A converted directory's stored dtype; an HF checkpoint's own dtype when it states a
    supported one; else float32 (GGUF files are dequantised to float32)."""
    from eagle_jax.convert import registry

    path = os.path.expanduser(source)
    if os.path.isdir(path) and registry.is_converted_dir(path):
        try:
            with open(os.path.join(path, registry.MARKER)) as f:
                dt = json.load(f).get("dtype")
        except (OSError, json.JSONDecodeError):
            dt = None
        return dt if isinstance(dt, str) and dt in _DTYPES else "float32"
    if os.path.isdir(path):
        try:
            config = _read_config(path) or {}
        except ConfigError:
            return "float32"
        dt = config.get("torch_dtype") or config.get("dtype")
        if isinstance(dt, str) and dt in _DTYPES:
            return dt
    return "float32"


def _target_config(name: str) -> TargetConfig:
    """The config of the target named by --target, reading only config files when possible."""
    from eagle_jax.convert import registry
    from eagle_jax.convert.hf import read_hf_config, target_config_from_hf

    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if registry.is_converted_dir(path):
            with open(os.path.join(path, registry.MARKER)) as f:
                return registry._cfg_from_json(json.load(f)["config"])
        if os.path.isfile(os.path.join(path, "config.json")):
            return target_config_from_hf(read_hf_config(path), name_or_path=os.path.abspath(path))
    # built-in names, GGUF files and hub ids: the (cached) loader
    return registry.load_target(name, dtype="float32").cfg


# ----------------------------------------------------------------------------- targets


def convert_target(source: str, output: str, dtype: str | None = None) -> dict:
    from eagle_jax.convert.drafter_config import is_drafter_config
    from eagle_jax.convert.registry import load_target, save_converted

    path = os.path.expanduser(source)
    if os.path.isdir(path):
        config = _read_config(path)
        if config is not None and is_drafter_config(config):
            raise ConvertError(f"{source} holds an EAGLE drafter config, not a target model; "
                               "use --kind drafter")
    dt = dtype or _default_target_dtype(source)
    t0 = time.perf_counter()
    target = load_target(source, dtype=dt, cache=False)
    out = save_converted(target, output)
    files, size = _dir_summary(out)
    cfg = target.cfg
    return {
        "kind": "target", "format": "eagle-jax", "source": target.source, "output": out,
        "dtype": dt, "architecture": cfg.architecture, "name_or_path": cfg.name_or_path,
        "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
        "num_params": _num_params(target.params), "has_tokenizer": target.tokenizer is not None,
        "files": files, "bytes": size, "seconds": round(time.perf_counter() - t0, 3),
    }


# ----------------------------------------------------------------------------- drafters


def convert_drafter(source: str, output: str, fmt: str = "speculators", target: str | None = None,
                    dtype: str | None = None) -> dict:
    from eagle_jax.convert.drafter_formats import checkpoint_format, load_drafter, save_drafter

    path = os.path.expanduser(source)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"drafter source {source!r} is not a directory (a drafter is a "
                                "checkpoint directory with config.json and model.safetensors)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"drafter source {source} has no config.json")
    target_cfg = _target_config(target) if target else None
    t0 = time.perf_counter()
    try:
        cfg, params, vocab = load_drafter(path, target_cfg=target_cfg, dtype=None)
    except ConfigError as e:
        if target_cfg is None and "target_cfg" in str(e):
            raise ConvertError(f"{e} (on the command line: pass --target)") from None
        raise
    if target_cfg is not None:
        verifier = target_cfg.name_or_path or target
        cfg = cfg.replace(verifier_name_or_path=verifier,
                          verifier_architecture=target_cfg.architecture)
    out = save_drafter(output, cfg, params, vocab, format=fmt, dtype=dtype, overwrite=True)
    files, size = _dir_summary(str(out))
    return {
        "kind": "drafter", "format": fmt, "source": os.path.abspath(path),
        "source_format": checkpoint_format(path), "output": str(Path(out).absolute()),
        "dtype": dtype or "as stored", "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.target_hidden_size, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size, "aux_layer_ids": list(cfg.aux_layer_ids),
        "eagle3.1": cfg.is_eagle31, "verifier": cfg.verifier_name_or_path or None,
        "num_params": _num_params(params), "files": files, "bytes": size,
        "seconds": round(time.perf_counter() - t0, 3),
    }


# ----------------------------------------------------------------------------- entry point


def run_convert(args) -> dict:
    """Carry out `eagle-jax convert` (argparse namespace: source, output, kind, format, target, dtype)."""
    source, fmt = args.source, args.format
    kind = getattr(args, "kind", None)
    dtype = getattr(args, "dtype", None)
    if dtype is not None and dtype not in _DTYPES:
        raise ConvertError(f"unknown --dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    expanded = os.path.expanduser(source)
    if kind == "drafter" and not os.path.exists(expanded):
        raise FileNotFoundError(f"drafter source {source!r} does not exist")
    if kind is None:
        kind = detect_kind(source)
    if kind == "target":
        if fmt not in (None, *TARGET_FORMATS):
            raise ConvertError(f"--format {fmt} is a drafter format; a target converts to "
                               "'eagle-jax' (or pass --kind drafter for a drafter source)")
        if getattr(args, "target", None):
            raise ConvertError("--target is only for drafters (the target a drafter belongs to)")
        out = _check_output(args.output)
        return convert_target(source, out, dtype)
    if kind == "drafter":
        fmt = fmt or "speculators"
        if fmt not in DRAFTER_FORMATS:
            raise ConvertError(f"--format {fmt} is not a drafter format; use one of "
                               f"{', '.join(DRAFTER_FORMATS)}")
        out = _check_output(args.output)
        return convert_drafter(source, out, fmt, getattr(args, "target", None), dtype)
    raise ConvertError(f"--kind must be 'target' or 'drafter', got {kind!r}")
