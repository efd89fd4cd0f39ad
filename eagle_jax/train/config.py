"""Every setting of a drafter training run: `TrainConfig` (the keys a YAML / JSON config may hold),
checked when made (`validate`: a ConfigError names the bad key).

Precision: ``dtype`` is the compute dtype of the target pass and of the
drafter (float32 or bfloat16); ``param_dtype`` is the dtype of the trained
parameters and of Adam's moments (default float32: master weights, cast to
the compute dtype inside the step; bfloat16 parameters lose updates smaller
than 2**-8 of a weight, i.e. most updates at lr 1e-4). ``target_dtype``
overrides ``dtype`` for the target pass alone (the features reach the drafter
cast to ``dtype``): on a Xeon with AMX the bf16 feature pass took 2.35 s against
6.14 in float32, a whole step 6.38 against 10.83 (benchmarks/train_step.py).

``parallel_drafting`` trains a parallel drafter (P-EAGLE, `DrafterConfig.mask_token_id`):
``ttt_length`` is then the K tokens one forward proposes, steps 1..K-1 fed the placeholder
token ``mask_token_id`` (its embedding is the target's, frozen) and the learned
``mask_hidden`` (train/ttt.py). P-EAGLE weighs its depths equally: ``step_decay: 1.0``.
Starting from a sequential drafter (``init_from``) adds a fresh ``mask_hidden``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import jax.numpy as jnp

from eagle_jax.config import ConfigError
from eagle_jax.sharding import parse_mesh
from eagle_jax.train import ttt

__all__ = ["TrainConfig", "VARIANTS", "DTYPES"]

VARIANTS = {"eagle3": dict(fc_norm=False, norm_output=False),
            "eagle3.1": dict(fc_norm=True, norm_output=True)}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _as_float(name: str, v: Any) -> float:
    """`v` as a finite float; a numeric string is read as its number, since YAML 1.1 (PyYAML) reads
    `2e-4`, written without a decimal point, as the string '2e-4'."""
    f = None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        f = float(v)
    elif isinstance(v, str):
        try:
            f = float(v)
        except ValueError:
            pass
    if f is None or not math.isfinite(f):
        raise ConfigError(f"{name} must be a finite number, got {v!r}")
    return f


@dataclass
class TrainConfig:
    """Every setting of a training run (the keys a YAML/JSON config may hold)."""

    # target and data
    target: str = "smollm2-135m-instruct"
    data: str = "sharegpt"  # "sharegpt" or a .jsonl / .jsonl.gz of {"id", "messages"} (or ShareGPT records)
    max_conversations: int | None = 2000
    heldout_fraction: float = 0.02
    max_length: int | None = None  # tokens kept per conversation (default seq_len)
    data_cache_dir: str | None = None  # tokenized-data cache (default output_dir/data)
    # drafter
    variant: str = "eagle3"  # eagle3 | eagle3.1 (= fc_norm + norm_output)
    draft_vocab_size: int = 8192
    aux_layer_ids: list[int] | None = None  # default: target.default_aux_layers()
    hidden_size: int | None = None  # drafter dims; default: the target's layer dims
    intermediate_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    parallel_drafting: bool = False  # a P-EAGLE drafter: ttt_length = the K tokens of one forward
    mask_token_id: int = 0  # its placeholder token (a parallel drafter's)
    init_from: str | None = None  # a drafter checkpoint dir to start from (its weights and draft vocab)
    resume_from: str | None = None  # a training state dir (train/state.py): its drafter, cursor, counts
    # optimisation
    steps: int = 1000
    batch_size: int = 4
    seq_len: int = 512
    bucket_lengths: list[int] | None = None  # pad each batch only to the smallest bucket that fits
    ttt_length: int = 3
    step_decay: float = 0.8
    labels: str = "soft"  # soft: the target's distribution over the draft vocab; hard: its argmax
    lr: float = 3e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 0.5
    dtype: str = "float32"  # compute dtype (target pass and drafter)
    target_dtype: str | None = None  # compute dtype of the target pass alone (default: dtype)
    param_dtype: str = "float32"  # trained params and Adam moments
    seed: int = 0
    argmax_mode: str = "chunked"  # in-draft-vocab test of the target argmax: chunked | full | skip
    feature_cache: bool = False  # keep target features on disk for later epochs
    feature_cache_dir: str | None = None
    # bookkeeping
    output_dir: str = "runs/drafter"
    resume: bool = True
    save_every: int = 200
    max_to_keep: int = 3
    log_every: int = 1
    progress: bool = True
    # evaluation through the real engine (greedy chain)
    eval_every: int = 0  # 0: only at the start and the end
    eval_at_start: bool = True
    eval_prompts: int = 4
    eval_max_new_tokens: int = 48
    eval_k: int = 5
    eval_max_prompt_tokens: int = 192
    # export
    export: bool = True
    export_format: str = "speculators"
    export_dtype: str | None = "bfloat16"  # None keeps param_dtype
    export_state: str | None = None  # write the end state here (train/state.py), e.g. train/state/eagle3.1
    learning_curve: bool = False  # append the run's point to benchmarks/results/learning_curve.jsonl
    impl: str = "auto"
    # A jax Mesh ("DATAxMODEL", eagle_jax/sharding.py): batches split over the data axis, the
    # frozen target over the model axis; the drafter and its optimizer state replicated, or
    # with `fsdp` split over the data axis.
    mesh: str | None = None
    fsdp: bool = False

    @classmethod
    def fields(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "config") -> "TrainConfig":
        known = set(cls.fields())
        for key in d:
            if key not in known:
                import difflib

                near = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ConfigError(f"{where}: unknown key {key!r}{hint}")
        return cls(**dict(d)).validate()

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes).validate()

    def validate(self) -> "TrainConfig":
        if self.variant not in VARIANTS:
            raise ConfigError(f"variant must be one of {sorted(VARIANTS)}, got {self.variant!r}")
        for name in ("dtype", "param_dtype", "target_dtype"):
            v = getattr(self, name)
            if v not in DTYPES and not (name == "target_dtype" and v is None):
                raise ConfigError(f"{name} must be float32 or bfloat16, got {getattr(self, name)!r}")
        if self.export_dtype not in (None, "float32", "bfloat16"):
            raise ConfigError(f"export_dtype must be float32, bfloat16 or null, got {self.export_dtype!r}")
        nullable = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "max_length")
        for name in ("steps", "batch_size", "seq_len", "ttt_length", "draft_vocab_size",
                     "save_every", "max_to_keep", "log_every", "eval_k", *nullable):
            v = getattr(self, name)
            if (v is not None or name not in nullable) and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{name} must be a positive integer{' or null' if name in nullable else ''}, "
                                  f"got {v!r}")
        for name in ("heldout_fraction", "step_decay", "lr", "min_lr_ratio", "weight_decay", "beta1", "beta2",
                     "grad_clip"):
            setattr(self, name, _as_float(name, getattr(self, name)))
        if self.ttt_length > self.seq_len - 2:
            raise ConfigError(f"ttt_length {self.ttt_length} needs seq_len >= ttt_length + 2")
        if self.labels not in ttt.LABELS:
            raise ConfigError(f"labels must be one of {list(ttt.LABELS)}, got {self.labels!r}")
        if self.argmax_mode not in ("chunked", "full", "skip"):
            raise ConfigError(f"argmax_mode must be chunked, full or skip, got {self.argmax_mode!r}")
        if self.bucket_lengths:
            self.bucket_lengths = sorted(int(b) for b in self.bucket_lengths)
            if self.bucket_lengths[-1] > self.seq_len or self.bucket_lengths[0] < self.ttt_length + 2:
                raise ConfigError("bucket_lengths must lie in [ttt_length + 2, seq_len]")
        if self.export_format not in ("speculators", "native"):
            raise ConfigError(f"export_format must be speculators or native, got {self.export_format!r}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ConfigError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if self.init_from and self.resume_from:
            raise ConfigError("give init_from or resume_from, not both (a state names its own drafter)")
        if self.mesh is not None:
            data = parse_mesh(self.mesh).data
            if self.batch_size % data:
                raise ConfigError(f"batch_size {self.batch_size} must be a multiple of the mesh's data axis ({data})")
        elif self.fsdp:
            raise ConfigError("fsdp shards the drafter over a mesh's data axis: give a mesh too")
        if not isinstance(self.mask_token_id, int) or isinstance(self.mask_token_id, bool) or self.mask_token_id < 0:
            raise ConfigError(f"mask_token_id must be a token id, got {self.mask_token_id!r}")
        if self.parallel_drafting and self.learning_curve:
            raise ConfigError("learning_curve measures through the engine, which drafts sequentially: "
                              "not with parallel_drafting")
        if (self.export_state or self.learning_curve) and not self.export:
            raise ConfigError("export_state and learning_curve need export: true (they use the exported drafter)")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
