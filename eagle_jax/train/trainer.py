"""Drafter training loop: optimiser, jitted TTT step, checkpoints, logs, evaluation, export.

    cfg = TrainConfig(output_dir="runs/x", steps=2000, ...)
    trainer = Trainer(cfg, target_cfg, target_params, train_examples, vocab,
                      eval_prompts=[[...token ids...], ...], tokenizer=tok)
    summary = trainer.run()

Drafter initialisation (`init_drafter_params`): every weight random
(``drafter.init_params``, normal(0, 0.02)) with all RMSNorm gains set to 1,
except

* ``lm_head`` = the target's output projection restricted to the draft
  vocabulary, ``Target.lm_head_weight()[:, target_ids]`` ([H, Vd]);
* ``norm`` = the target's final norm ``final_norm``.

Both need ``hidden_size == target hidden_size`` (true for the usual EAGLE-3
drafters, which copy the target's layer shape); otherwise they stay random.
With ``init_from`` (a drafter checkpoint directory in any format
``load_drafter`` reads) a fresh run starts from that drafter's weights and
keeps its draft vocabulary instead (`load_init_drafter`): fine-tuning a
released drafter, or continuing one on new data. Its shape, variant and aux
layers must equal the configured ones; a larger configured
``draft_vocab_size`` widens its vocabulary (train/cli.py adds the most
frequent ids of the data, `widen_lm_head` head columns for them mapped from
the target's), and a larger ``intermediate_size`` its MLP (`widen_mlp`: new
units whose down-projection rows are zero, so the function is unchanged).
``resume_from`` (a committed training state, train/state.py) does the same
with the state's drafter, continues the state's data cursor when the data
order is the same, and adds the state's
steps and token positions to the run's; ``export_state`` writes the run's
end state (its exported drafter, steps, token positions, cursor, data,
settings) to a state directory; ``learning_curve`` appends the run's point to
benchmarks/results/learning_curve.jsonl (benchmarks/learning_curve.py).
The embedding is the target's ``embed`` [V, H], passed to every step as a
frozen input: it is not part of the trained parameters, the optimiser state,
the checkpoints or the export (``has_embedding`` stays False).

Optimiser: ``clip_by_global_norm(grad_clip)`` then AdamW (betas 0.9/0.95 by
default) with linear warmup to ``lr`` over ``warmup_steps`` and cosine
decay to ``lr * min_lr_ratio`` at ``steps``.

Precision: ``dtype`` is the compute dtype of the target pass and of the
drafter (float32 or bfloat16); ``param_dtype`` is the dtype of the trained
parameters and of Adam's moments (default float32: master weights, cast to
the compute dtype inside the step; bfloat16 parameters lose updates smaller
than 2**-8 of a weight, i.e. most updates at lr 1e-4). ``target_dtype``
overrides ``dtype`` for the target pass alone (the features reach the drafter
cast to ``dtype``): on a Xeon with AMX the bf16 feature pass took 2.35 s against
6.14 in float32, a whole step 6.38 against 10.83 (benchmarks/train_step.py).

Checkpoints (orbax ``CheckpointManager`` under ``output_dir/checkpoints``,
synchronous, every ``save_every`` steps and at the end, ``max_to_keep``):
item ``state`` = {step, params, opt_state, key} and item ``meta`` (JSON) =
{step, cursor (index of the next batch), elapsed_s, token_positions (batch
rows x padded length, summed over the run's steps), config}. A step
directory appears by rename only when complete, so a process killed at any
moment resumes from the last complete checkpoint; the data order is a pure
function of (seed, cursor), so a resumed run sees exactly the batches the
uninterrupted one would have.

Outputs in ``output_dir``: ``train_log.jsonl`` (one JSON object per logged
step and per evaluation), ``training_curves.png``, ``drafter/`` (speculators
format, ``save_drafter``) and ``model_card.md`` (also copied into ``drafter/``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eagle_jax.config import ConfigError, DrafterConfig, TargetConfig
from eagle_jax.kernels import ops
from eagle_jax.models import drafter, target
from eagle_jax.runtime import machine_info
from eagle_jax.train import data as data_lib
from eagle_jax.train import features as features_lib
from eagle_jax.train import ttt

__all__ = [
    "TrainConfig",
    "VARIANTS",
    "build_drafter_config",
    "init_drafter_params",
    "load_init_drafter",
    "widen_lm_head",
    "widen_mlp",
    "init_source",
    "make_optimizer",
    "make_train_step",
    "iter_batches",
    "evaluate_acceptance",
    "Trainer",
]

VARIANTS = {"eagle3": dict(fc_norm=False, norm_output=False),
            "eagle3.1": dict(fc_norm=True, norm_output=True)}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


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
            if v not in _DTYPES and not (name == "target_dtype" and v is None):
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
        if (self.export_state or self.learning_curve) and not self.export:
            raise ConfigError("export_state and learning_curve need export: true (they use the exported drafter)")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- model setup

def build_drafter_config(tcfg: TargetConfig, cfg: TrainConfig) -> DrafterConfig:
    """The drafter for `tcfg`: the target's layer shape unless overridden, its RoPE and eps."""
    aux = tuple(cfg.aux_layer_ids) if cfg.aux_layer_ids else tcfg.default_aux_layers()
    return DrafterConfig(
        hidden_size=cfg.hidden_size or tcfg.hidden_size,
        intermediate_size=cfg.intermediate_size or tcfg.intermediate_size,
        num_heads=cfg.num_heads or tcfg.num_heads,
        num_kv_heads=cfg.num_kv_heads or tcfg.num_kv_heads,
        head_dim=cfg.head_dim or tcfg.head_dim,
        vocab_size=tcfg.vocab_size,
        draft_vocab_size=cfg.draft_vocab_size,
        target_hidden_size=tcfg.hidden_size,
        aux_layer_ids=tuple(sorted(aux)),
        rms_norm_eps=tcfg.rms_norm_eps,
        rope=tcfg.rope,
        max_position_embeddings=tcfg.max_position_embeddings,
        verifier_name_or_path=tcfg.name_or_path or cfg.target,
        verifier_architecture=tcfg.architecture,
        speculative_tokens=cfg.eval_k,
        **VARIANTS[cfg.variant],
    )


def init_drafter_params(dcfg: DrafterConfig, tcfg: TargetConfig, tparams, vocab: drafter.DraftVocab,
                        key, dtype=jnp.float32) -> dict:
    """Random drafter weights, norms at 1, lm_head/norm copied from the target (module docstring)."""
    params = drafter.init_params(dcfg, key, dtype=jnp.float32)
    ones = lambda x: jnp.ones_like(x)
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        params["layer"][name] = ones(params["layer"][name])
    for name in ("norm", "fc_norm", "input_norm"):
        if name in params:
            params[name] = ones(params[name])
    if dcfg.hidden_size == tcfg.hidden_size:
        w = target.Target(tcfg, tparams).lm_head_weight()
        params["lm_head"] = jnp.take(w, vocab.target_ids, axis=1).astype(jnp.float32)
        # a copy: the train step donates the params, which must not alias the target's
        params["norm"] = jnp.array(tparams["final_norm"], jnp.float32, copy=True)
    return jax.tree.map(lambda x: x.astype(dtype), params)


_INIT_FIELDS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                "target_hidden_size", "aux_layer_ids", "fc_norm", "norm_before_fc",
                "norm_before_residual", "norm_output", "qkv_bias", "o_bias")


def load_init_drafter(path: str | os.PathLike, dcfg: DrafterConfig, tcfg: TargetConfig,
                      dtype=jnp.float32) -> tuple[dict, drafter.DraftVocab]:
    """(params in `dtype`, draft vocab) of the drafter at `path`; ConfigError if it is not `dcfg`'s shape.

    Its draft vocabulary and its MLP may be smaller than `dcfg`'s: the run then widens them
    (`widen_lm_head`, `widen_mlp`)."""
    from eagle_jax.convert.drafter_formats import load_drafter

    lcfg, params, vocab = load_drafter(path, tcfg, dtype=jnp.float32)
    diff = [f"{k} {getattr(lcfg, k)!r} (config: {getattr(dcfg, k)!r})" for k in _INIT_FIELDS
            if getattr(lcfg, k) != getattr(dcfg, k)]
    if lcfg.draft_vocab_size > dcfg.draft_vocab_size:
        diff.append(f"draft_vocab_size {lcfg.draft_vocab_size!r} (config: {dcfg.draft_vocab_size!r}; "
                    "a draft vocabulary can be widened, not narrowed)")
    if lcfg.intermediate_size > dcfg.intermediate_size:
        diff.append(f"intermediate_size {lcfg.intermediate_size!r} (config: {dcfg.intermediate_size!r}; "
                    "an MLP can be widened, not narrowed)")
    if diff:
        raise ConfigError(f"init_from {path}: the drafter there differs from the configured one: "
                          + "; ".join(diff))
    if lcfg.has_embedding:
        raise ConfigError(f"init_from {path}: the drafter carries its own embedding; training here "
                          "uses the target's (frozen) embedding")
    return jax.tree.map(lambda x: jnp.array(x, dtype, copy=True), params), vocab


def widen_lm_head(params: dict, old: drafter.DraftVocab, new: drafter.DraftVocab, tcfg: TargetConfig,
                  tparams) -> dict:
    """`params` with ``lm_head`` [H, Vd_old] grown to `new`'s [H, Vd_new] (``train/vocab.py widen_draft_vocab``).

    The columns of `old`'s ids are kept, so the widened drafter scores them exactly as before. An added
    id's column is the target's column carried into the drafter's space: ``A @ W[:, id]``, with ``A``
    [H, H] the least-squares map from the target's columns of the old ids to the drafter's trained
    ones. (The target's columns as they are would not do: the trained drafter's head has drifted from
    them, and on SmolLM2 the raw columns of rare tokens outscored every trained one.)
    """
    old_ids, new_ids = np.asarray(old.target_ids), np.asarray(new.target_ids)
    if not np.isin(old_ids, new_ids).all():
        raise ConfigError(f"the draft vocabulary given to the trainer ({len(new_ids)} ids) does not hold all "
                          f"{len(old_ids)} of the starting drafter's: only a widened one can continue it")
    head = np.asarray(params["lm_head"], np.float64)
    if head.shape[0] != tcfg.hidden_size:
        raise ConfigError(f"cannot widen the draft vocabulary: the drafter's hidden size {head.shape[0]} is not "
                          f"the target's {tcfg.hidden_size}, so the target's lm_head columns do not fit")
    w = np.asarray(target.Target(tcfg, tparams).lm_head_weight(), np.float64)
    a_t, *_ = np.linalg.lstsq(w[:, old_ids].T, head.T, rcond=None)  # w_old.T @ A.T ~= head.T
    out = a_t.T @ w[:, new_ids]
    out[:, np.searchsorted(new_ids, old_ids)] = head
    return dict(params, lm_head=jnp.asarray(out, params["lm_head"].dtype))


def widen_mlp(params: dict, width: int, key, scale: float = 0.02) -> dict:
    """`params` with the decoder layer's MLP grown from F to `width` hidden units, the function unchanged.

    ``w_gate_up`` [H, 2F] ([gate | up]) gets `width` - F new gate and up columns, normal(0, `scale`) as
    `drafter.init_params` draws them; ``w_down`` [F, H] gets zero rows for them, so the widened
    drafter computes exactly what it did. The first update gives the new units' down rows a
    gradient (their activations are not zero), and through those their gate and up columns.
    """
    layer = params["layer"]
    gate_up, down = layer["w_gate_up"], layer["w_down"]
    f = down.shape[0]
    if width < f:
        raise ConfigError(f"cannot narrow the drafter's MLP from {f} to {width} units")
    if width == f:
        return params
    h = gate_up.shape[0]
    new = (scale * jax.random.normal(key, (2, h, width - f))).astype(gate_up.dtype)
    gate_up = jnp.concatenate([gate_up[:, :f], new[0], gate_up[:, f:], new[1]], axis=1)
    down = jnp.concatenate([down, jnp.zeros((width - f, down.shape[1]), down.dtype)], axis=0)
    return dict(params, layer=dict(layer, w_gate_up=gate_up, w_down=down))


def init_source(cfg: TrainConfig) -> str | None:
    """The drafter directory a fresh run starts from: ``init_from``, or the drafter of ``resume_from``."""
    if cfg.resume_from:
        from eagle_jax.train import state as state_lib

        return state_lib.read_state(cfg.resume_from)["drafter"]
    return cfg.init_from


def make_schedule(cfg: TrainConfig):
    warm = max(0, min(cfg.warmup_steps, cfg.steps - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warm,
        decay_steps=max(cfg.steps, warm + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def _optimizer_key(cfg: TrainConfig) -> tuple:
    return (cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio, cfg.weight_decay, cfg.beta1, cfg.beta2,
            cfg.grad_clip)


_JIT_CACHE: dict = {}


def make_optimizer(cfg: TrainConfig):
    schedule = make_schedule(cfg)
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                     optax.adamw(schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay))
    return tx, schedule


def make_train_step(dcfg: DrafterConfig, tx, *, ttt_length: int, step_decay: float = 0.8,
                    labels: str = "soft", compute_dtype=jnp.float32, impl: str = "auto"):
    """A jitted ``train_step(state, embed, batch) -> (state, metrics)`` (state donated).

    batch: input_ids, loss_mask, lengths, aux [B,T,A*Ht], target_logits
    [B,T,Vd] float32, in_vocab [B,T] bool.
    """

    def loss_fn(params, embed, batch):
        p = jax.tree.map(lambda x: x.astype(compute_dtype), params)
        logits = ttt.unroll(p, dcfg, embed.astype(compute_dtype), batch["aux"].astype(compute_dtype),
                            batch["input_ids"], batch["lengths"], ttt_length, impl=impl)
        return ttt.ttt_loss(logits, batch["target_logits"], batch["in_vocab"], batch["loss_mask"],
                            step_decay=step_decay, labels=labels, impl=impl)

    @partial(jax.jit, donate_argnums=(0,))
    def train_step(state, embed, batch):
        (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], embed, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        m = dict(m, loss=loss, grad_norm=optax.tree.norm(grads))
        return dict(state, params=params, opt_state=opt_state, step=state["step"] + 1), m

    return train_step


# ----------------------------------------------------------------------------- data

def iter_batches(examples: Sequence[Mapping], batch_size: int, seq_len: int, *, seed: int = 0,
                 start: int = 0, bucket_lengths: Sequence[int] | None = None,
                 pad_id: int = 0) -> Iterator[dict]:
    """Endless ``data.batches`` from the global batch cursor ``start``; an
    error (not silence) when the examples cannot fill one batch."""
    if data_lib.num_batches(len(examples), batch_size, True) == 0:
        raise ValueError(f"{len(examples)} training examples cannot fill one batch of {batch_size}")
    return data_lib.batches(examples, batch_size, seq_len, seed=seed, start=start, epochs=None,
                            bucket_lengths=bucket_lengths, pad_id=pad_id)


# ----------------------------------------------------------------------------- evaluation

def evaluate_acceptance(tcfg: TargetConfig, tparams, tokenizer, dcfg: DrafterConfig, dparams,
                        vocab, prompts: Sequence[Sequence[int]], *, k: int = 5,
                        max_new_tokens: int = 48) -> dict:
    """Greedy chain drafting with k tokens through `eagle_jax.generate.Generator`."""
    from eagle_jax.config import SpecConfig
    from eagle_jax.generate import Generator

    dtype = tparams["embed"].dtype
    dp = jax.tree.map(lambda x: jnp.asarray(x).astype(dtype), dparams)
    gen = Generator(tcfg, tparams, tokenizer, drafter=(dcfg, dp, vocab),
                    spec=SpecConfig("chain", num_speculative_tokens=k, disable_by_batch_size=None),
                    unroll_layers=False)  # acceptance only: the scanned layers compile faster
    t0 = time.perf_counter()
    res = gen.generate([list(map(int, p)) for p in prompts], max_new_tokens=max_new_tokens)
    wall = time.perf_counter() - t0
    s = res.stats
    return {"tau": s.get("acceptance_length"), "per_position": s.get("per_position_acceptance"),
            "draft_acceptance_rate": s.get("draft_acceptance_rate"),
            "verify_steps": s.get("num_verify_steps"), "generated": res.num_generated,
            "wall_s": wall, "k": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens}


# ----------------------------------------------------------------------------- helpers

def _seconds(x) -> str:
    return f"{x:.1f} s" if x is not None else "not measured in this process"


def _to_host(tree):
    return jax.tree.map(lambda x: np.asarray(x), tree)


def read_log(path: str | os.PathLike) -> list[dict]:
    out = []
    p = Path(path)
    if not p.is_file():
        return out
    for line in p.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill
                pass
    return out


def plot_curves(log_path, png_path) -> None:
    """Loss, per-step accuracy and tau against the step, from train_log.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_log(log_path)
    train = {r["step"]: r for r in recs if r.get("type") == "train"}  # last record per step wins
    evals = {r["step"]: r for r in recs if r.get("type") == "eval"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = sorted(train)
    if steps:
        loss = np.array([train[s]["loss"] for s in steps])
        axes[0].plot(steps, loss, lw=0.6, alpha=0.4, label="loss")
        w = max(1, len(steps) // 50)
        if w > 1:
            sm = np.convolve(loss, np.ones(w) / w, mode="valid")
            axes[0].plot(steps[w - 1:], sm, label=f"loss (mean of {w})")
        acc = np.array([train[s]["acc_i"] for s in steps])
        for i in range(acc.shape[1]):
            a = acc[:, i]
            if w > 1:
                a = np.convolve(a, np.ones(w) / w, mode="valid")
            axes[1].plot(steps[len(steps) - len(a):], a, label=f"step {i}")
    axes[0].set_title("TTT loss")
    axes[0].set_xlabel("step")
    axes[1].set_title("top-1 accuracy per TTT step")
    axes[1].set_xlabel("step")
    if steps:
        axes[0].legend()
        axes[1].legend()
    es = sorted(s for s in evals if evals[s].get("tau") is not None)
    if es:
        axes[2].plot(es, [evals[s]["tau"] for s in es], "o-", label="tau (greedy chain)")
        axes[2].legend()
    axes[2].set_title("acceptance length")
    axes[2].set_xlabel("step")
    fig.tight_layout()
    from eagle_jax.benchmarks.report import save_png

    save_png(fig, png_path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- trainer

# Settings whose change makes a resumed run differ from the uninterrupted one.
_RESUME_KEYS = ("variant", "draft_vocab_size", "intermediate_size", "batch_size", "seq_len", "bucket_lengths",
                "ttt_length",
                "step_decay", "labels", "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "beta1", "beta2",
                "grad_clip", "dtype", "target_dtype", "param_dtype", "seed", "data", "max_conversations", "target",
                "steps", "init_from", "resume_from")
# The settings a learning-curve point and a training state record.
_RECORDED_KEYS = ("target", "variant", "draft_vocab_size", "intermediate_size", "ttt_length", "step_decay",
                  "labels", "lr", "warmup_steps", "min_lr_ratio", "steps", "batch_size", "seq_len", "bucket_lengths",
                  "dtype", "target_dtype", "param_dtype", "seed", "data", "max_conversations", "heldout_fraction",
                  "init_from", "resume_from", "output_dir")


class Trainer:
    """One training run (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, target_cfg: TargetConfig, target_params,
                 train_examples: Sequence[Mapping], vocab: drafter.DraftVocab, *,
                 eval_prompts: Sequence[Sequence[int]] = (), tokenizer=None,
                 data_info: Mapping | None = None, pad_id: int = 0):
        cfg.validate()
        self.cfg = cfg
        self.tcfg = target_cfg
        self.tparams = target_params
        self.examples = train_examples
        self.vocab = vocab
        self.eval_prompts = [list(p) for p in eval_prompts][: cfg.eval_prompts]
        self.tokenizer = tokenizer
        self.data_info = dict(data_info or {})
        self.pad_id = pad_id
        from eagle_jax.train import state as state_lib

        self.resume_state = state_lib.read_state(cfg.resume_from) if cfg.resume_from else None
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path = self.out / "train_log.jsonl"
        self.dcfg = build_drafter_config(target_cfg, cfg)
        self.compute_dtype = _DTYPES[cfg.dtype]
        # the target pass may run in another dtype than the drafter (target_dtype: bf16 features on CPU)
        feature_dtype = _DTYPES[cfg.target_dtype or cfg.dtype]
        self.feature_params = (target_params if jax.tree.leaves(target_params)[0].dtype == feature_dtype
                               else jax.tree.map(lambda x: jnp.asarray(x, feature_dtype), target_params))
        # the decoder layers of the feature pass run on the native kernels' packed weights where they load
        # (benchmarks/results/analysis.md, "Training twice as fast on CPU")
        self.impl = ops.resolve(cfg.impl)  # once: the jitted step and feature pass carry it
        self.forward_params = (target.prepare_for_decoding(self.feature_params, target_cfg, impl=self.impl)
                               if self.impl == "native" else None)
        self.param_dtype = _DTYPES[cfg.param_dtype]
        self.tx, self.schedule = make_optimizer(cfg)
        # Jitted functions are shared by trainers with the same static settings (a restarted
        # trainer in the same process does not compile again).
        step_key = ("step", self.dcfg, _optimizer_key(cfg), cfg.ttt_length, cfg.step_decay, cfg.labels,
                    cfg.dtype, self.impl)
        if step_key not in _JIT_CACHE:
            _JIT_CACHE[step_key] = make_train_step(self.dcfg, self.tx, ttt_length=cfg.ttt_length,
                                                   step_decay=cfg.step_decay, labels=cfg.labels,
                                                   compute_dtype=self.compute_dtype, impl=self.impl)
        self.train_step = _JIT_CACHE[step_key]
        feat_key = ("features", target_cfg, self.dcfg.aux_layer_ids, cfg.argmax_mode, self.impl,
                    cfg.feature_cache)
        if feat_key not in _JIT_CACHE:
            _JIT_CACHE[feat_key] = features_lib.make_feature_fn(
                target_cfg, self.dcfg.aux_layer_ids, argmax_mode=cfg.argmax_mode, impl=self.impl,
                return_normed=cfg.feature_cache)
        self.feature_fn = _JIT_CACHE[feat_key]
        self.logits_fn = jax.jit(partial(features_lib.draft_vocab_logits, tcfg=target_cfg))
        self.target_ids = jnp.asarray(vocab.target_ids, jnp.int32)
        self.t2d = jnp.asarray(vocab.t2d, bool)
        self.feature_cache = None
        if cfg.feature_cache:
            meta = {"target": target_cfg.name_or_path or cfg.target, "aux": list(self.dcfg.aux_layer_ids),
                    "dtype": cfg.target_dtype or cfg.dtype, "vocab": int(np.asarray(vocab.target_ids).sum()),
                    "n": len(train_examples), "seq_len": cfg.seq_len, "argmax": cfg.argmax_mode}
            self.feature_cache = features_lib.FeatureCache(
                cfg.feature_cache_dir or (self.out / "features"), meta)
        self._mngr = None
        self.widened = False  # set by init_state: the starting drafter's vocabulary was smaller
        self.widened_mlp_from = None  # set by init_state: the starting drafter's MLP width, when smaller

    # -------------------------------------------------------------- state and checkpoints
    def init_state(self) -> dict:
        key = jax.random.PRNGKey(self.cfg.seed)
        key, sub = jax.random.split(key)
        source = init_source(self.cfg)
        if source:
            params, vocab = load_init_drafter(source, self.dcfg, self.tcfg, self.param_dtype)
            self.widened = len(vocab.target_ids) < len(self.vocab.target_ids)
            if self.widened:
                params = widen_lm_head(params, vocab, self.vocab, self.tcfg, self.tparams)
            elif not np.array_equal(np.asarray(vocab.target_ids), np.asarray(self.vocab.target_ids)):
                raise ConfigError(f"init_from {source}: its draft vocabulary differs from the "
                                  "one given to the trainer")
            width = params["layer"]["w_down"].shape[0]
            if width < self.dcfg.intermediate_size:
                self.widened_mlp_from = width
                params = widen_mlp(params, self.dcfg.intermediate_size, jax.random.fold_in(sub, 1))
        else:
            params = init_drafter_params(self.dcfg, self.tcfg, self.tparams, self.vocab, sub,
                                         dtype=self.param_dtype)
        return {"step": jnp.zeros((), jnp.int32), "params": params,
                "opt_state": self.tx.init(params), "key": key}

    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"

    def manager(self):
        import orbax.checkpoint as ocp

        if self._mngr is None:
            self._mngr = ocp.CheckpointManager(
                self.ckpt_dir.absolute(),
                options=ocp.CheckpointManagerOptions(max_to_keep=self.cfg.max_to_keep, create=True,
                                                     enable_async_checkpointing=False,
                                                     cleanup_tmp_directories=True),
                item_names=("state", "meta"))
        return self._mngr

    def save(self, state, meta: dict) -> None:
        import orbax.checkpoint as ocp

        step = int(meta["step"])
        mngr = self.manager()
        if step in mngr.all_steps():
            return
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                meta=ocp.args.JsonSave(meta)), force=True)
        mngr.wait_until_finished()

    def restore(self, template) -> tuple[dict, dict] | None:
        import orbax.checkpoint as ocp

        mngr = self.manager()
        step = mngr.latest_step()
        if step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                         meta=ocp.args.JsonRestore()))
        return got["state"], dict(got["meta"])

    # -------------------------------------------------------------- logging
    def _log(self, rec: dict) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    # -------------------------------------------------------------- features
    def batch_features(self, batch) -> dict:
        tokens = jnp.asarray(batch["input_ids"])
        idx = batch["example_indices"]
        fc = self.feature_cache
        if fc is not None and fc.has_all([i for i in idx if i >= 0]) and fc.num_shards:
            aux, normed, in_vocab = fc.collate(idx, tokens.shape[1], self.dcfg.fc_in_size)
            aux = jnp.asarray(aux, self.compute_dtype)
            normed = jnp.asarray(normed, self.compute_dtype)
            logits = self.logits_fn(self.feature_params, normed=normed, target_ids=self.target_ids)
            feats = features_lib.Features(aux, logits, jnp.asarray(in_vocab))
        elif fc is not None:
            feats, normed = self.feature_fn(self.feature_params, tokens, self.target_ids, self.t2d,
                                            self.forward_params)
            aux_h, normed_h, iv_h = np.asarray(feats.aux), np.asarray(normed), np.asarray(feats.in_vocab)
            for r, k in enumerate(idx):
                if k >= 0:
                    n = int(batch["lengths"][r])
                    fc.add(int(k), aux_h[r, :n], normed_h[r, :n], iv_h[r, :n])
        else:
            feats = self.feature_fn(self.feature_params, tokens, self.target_ids, self.t2d, self.forward_params)
        return {"input_ids": tokens, "loss_mask": jnp.asarray(batch["loss_mask"]),
                "lengths": jnp.asarray(batch["lengths"]), "aux": feats.aux.astype(self.compute_dtype),
                "target_logits": feats.logits, "in_vocab": feats.in_vocab}

    # -------------------------------------------------------------- evaluation
    def evaluate(self, params, step: int) -> dict | None:
        if not self.eval_prompts:
            return None
        rec = evaluate_acceptance(self.tcfg, self.tparams, self.tokenizer, self.dcfg, params,
                                  self.vocab, self.eval_prompts, k=self.cfg.eval_k,
                                  max_new_tokens=self.cfg.eval_max_new_tokens)
        rec = {"type": "eval", "step": step, **rec}
        self._log(rec)
        try:
            plot_curves(self.log_path, self.out / "training_curves.png")
        except Exception as e:  # a plot must never stop training
            print(f"[train] plot failed: {e}", file=sys.stderr)
        return rec

    # -------------------------------------------------------------- main loop
    def run(self, *, stop_after: int | None = None) -> dict:
        """Train to ``cfg.steps`` (or stop after ``stop_after`` more steps, for tests)."""
        cfg = self.cfg
        state = self.init_state()
        start, elapsed_before, positions = 0, 0.0, 0
        restored = self.restore(state) if cfg.resume else None
        if not cfg.resume and self.ckpt_dir.exists() and self.manager().latest_step() is not None:
            raise FileExistsError(f"{self.ckpt_dir} holds checkpoints and resume is off: "
                                  "use another output_dir or --resume")
        if restored is not None:
            state, meta = restored
            old = meta.get("config") or {}
            # a key missing from an older checkpoint's config had its default then
            defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
            changed = {k: [old.get(k, defaults[k]), getattr(cfg, k)] for k in _RESUME_KEYS
                       if old.get(k, defaults[k]) != getattr(cfg, k)}
            if changed:
                print(f"[train] warning: resuming with changed {', '.join(changed)} "
                      f"(was {', '.join(repr(v[0]) for v in changed.values())}): the run is no longer the "
                      "continuation of the checkpointed one", file=sys.stderr)
            self._log({"type": "resume", "step": int(meta["step"]), "cursor": int(meta["cursor"]),
                       "changed": changed})
            start = int(meta["cursor"])
            elapsed_before = float(meta.get("elapsed_s", 0.0))
            positions = int(meta.get("token_positions", 0))
            print(f"[train] resumed from step {int(meta['step'])} (cursor {start})", file=sys.stderr)
        elif self.resume_state is not None:
            from eagle_jax.train import state as state_lib

            start, why = state_lib.start_batch(self.resume_state["cursor"], self.data_cursor(0))
            self._log({"type": "resume_from", "state": cfg.resume_from, "drafter": self.resume_state["drafter"],
                       "state_step": self.resume_state["step"],
                       "state_token_positions": self.resume_state["token_positions"], "start_batch": start,
                       "why": why})
            print(f"[train] starting from the state {cfg.resume_from}: {why}", file=sys.stderr)
        embed = jnp.asarray(self.tparams["embed"])
        step = int(state["step"])
        end = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)
        evals = []
        if cfg.eval_at_start and step == 0 and end > 0:
            evals.append(self.evaluate(state["params"], 0))
        batches = iter_batches(self.examples, cfg.batch_size, cfg.seq_len, seed=cfg.seed, start=start,
                               bucket_lengths=cfg.bucket_lengths, pad_id=self.pad_id)
        bar = None
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=step, dynamic_ncols=True, desc="train", file=sys.stderr)
        t_run = time.perf_counter()
        tokens_seen = real_seen = 0
        train_s = 0.0  # step time after the first (compiling) step
        compile_s = None
        last = {}
        cursor = start
        while step < end:
            batch = next(batches)
            t0 = time.perf_counter()
            feats = self.batch_features(batch)
            state, m = self.train_step(state, embed, feats)
            m = jax.device_get(m)
            dt = time.perf_counter() - t0
            cursor = batch["index"] + 1
            step += 1
            ntok = int(np.prod(batch["input_ids"].shape))
            nreal = int(batch["lengths"].sum())
            positions += ntok
            if compile_s is None:
                compile_s = dt
            else:
                tokens_seen += ntok
                real_seen += nreal
                train_s += dt
            spent = train_s
            tok_s = tokens_seen / spent if tokens_seen and spent > 0 else float("nan")
            last = {"type": "train", "step": step, "loss": float(m["loss"]),
                    "loss_i": [float(x) for x in m["loss_i"]], "acc_i": [float(x) for x in m["acc_i"]],
                    "count_i": [int(x) for x in m["count_i"]], "grad_norm": float(m["grad_norm"]),
                    "lr": float(self.schedule(step - 1)), "step_s": dt, "tokens": ntok,
                    "real_tokens": nreal, "tok_s": tok_s,
                    "real_tok_s": real_seen / spent if real_seen and spent > 0 else float("nan"),
                    "epoch": int(batch["epoch"]),
                    "elapsed_s": elapsed_before + time.perf_counter() - t_run}
            if step % cfg.log_every == 0 or step == end:
                self._log(last)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.3f}",
                                acc="/".join(f"{a:.2f}" for a in last["acc_i"]),
                                tok_s=f"{tok_s:.0f}")
            meta = {"step": step, "cursor": cursor, "elapsed_s": last["elapsed_s"],
                    "token_positions": positions, "config": cfg.to_dict()}
            if step % cfg.save_every == 0 or step == cfg.steps:
                self.save(state, meta)
            if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
                evals.append(self.evaluate(state["params"], step))
        if bar is not None:
            bar.close()
        if self.feature_cache is not None:
            self.feature_cache.flush()
        if not last:  # resumed at the end (e.g. to export): the last step is in the log
            last = next((r for r in reversed(read_log(self.log_path))
                         if r.get("type") == "train" and r.get("step", 0) <= step), {})
        summary = {"step": step, "last": last, "compile_s": compile_s, "token_positions": positions,
                   "wall_s": elapsed_before + time.perf_counter() - t_run}
        if step >= cfg.steps:
            final_eval = self.evaluate(state["params"], step) if self.eval_prompts else None
            summary["eval"] = final_eval
            summary["start_eval"] = next((e for e in evals if e and e["step"] == 0), None) or next(
                (r for r in read_log(self.log_path) if r.get("type") == "eval" and r.get("step") == 0), None)
            try:
                plot_curves(self.log_path, self.out / "training_curves.png")
            except Exception as e:
                print(f"[train] plot failed: {e}", file=sys.stderr)
            if cfg.export:
                summary["export"] = str(self.export(state["params"]))
            self.write_model_card(summary)
            training = self.training_record(step, positions, cursor)
            if cfg.export_state:
                summary["state"] = str(self.export_state(training))
            if cfg.learning_curve:
                summary["learning_curve"] = self.append_learning_curve(training)
        if self.feature_cache is not None:
            summary["feature_cache_bytes"] = self.feature_cache.size_bytes()
        self.state = state
        return summary

    # -------------------------------------------------------------- training state, learning curve
    def data_cursor(self, next_batch: int) -> dict:
        """This run's data order (train/state.py CURSOR_KEYS) and the index of its next batch."""
        from eagle_jax.train import state as state_lib

        cfg = self.cfg
        return {"data": cfg.data, "max_conversations": cfg.max_conversations, "seed": cfg.seed,
                "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                "examples_sha1": state_lib.examples_sha1(self.examples), "next_batch": int(next_batch)}

    def training_record(self, step: int, positions: int, cursor: int) -> dict:
        """Steps, token positions (with the state's when resumed from one), cursor, data and settings."""
        cfg, before = self.cfg, self.resume_state
        source = f"batch rows x padded length over the {step} steps of {cfg.output_dir} ({positions})"
        if before is not None:
            source += f" + the state {cfg.resume_from} ({before['token_positions']}: {before['token_positions_source']})"
        elif cfg.init_from:
            source += f" + the unrecorded positions of init_from {cfg.init_from}"
        run = {"date": time.strftime("%Y-%m-%d"), "output_dir": cfg.output_dir, "steps": step,
               "token_positions": positions, "start": cfg.resume_from or cfg.init_from or "random init"}
        return {"token_positions": positions + (before["token_positions"] if before else 0),
                "token_positions_source": source, "steps": step + (before["step"] if before else 0),
                "data": self.data_info.get("sources") or [{"source": cfg.data, "examples": len(self.examples)}],
                "settings": {k: getattr(cfg, k) for k in _RECORDED_KEYS},
                "runs": (before.get("runs", []) if before else []) + [run], "cursor": self.data_cursor(cursor)}

    def export_state(self, training: dict) -> Path:
        from eagle_jax.train import state as state_lib

        return state_lib.write_state(self.cfg.export_state, drafter=self.out / "drafter", copy_drafter=True,
                                     step=training["steps"], token_positions=training["token_positions"],
                                     token_positions_source=training["token_positions_source"],
                                     cursor=training["cursor"], data=training["data"],
                                     settings=training["settings"], runs=training["runs"])

    def append_learning_curve(self, training: dict) -> dict:
        """Measure the exported drafter at the learning curve's fixed setting (float32) and append its point."""
        from eagle_jax.benchmarks import learning_curve as lc
        from eagle_jax.convert.drafter_formats import load_drafter

        tcfg, tparams, tok = self.tcfg, self.tparams, self.tokenizer
        if tparams["embed"].dtype != jnp.float32:
            from eagle_jax.convert.registry import load_target

            lt = load_target(self.cfg.target, dtype="float32")
            tcfg, tparams, tok = lt.cfg, lt.params, lt.tokenizer
        heldout = lc.read_heldout_set(lc.HELDOUT_SET)
        drafter_dir = self.out / "drafter"
        measured = lc.measure(tcfg, tparams, tok, load_drafter(drafter_dir, tcfg), heldout)
        point = lc.make_point(os.path.basename(os.path.normpath(self.cfg.output_dir)), str(drafter_dir),
                              self.cfg.variant, {k: v for k, v in training.items() if k != "cursor"},
                              measured, heldout)
        lc.append_point(point, lc.CURVE_FILE)
        print(f"[train] learning curve: {lc.summary_line(point)}", file=sys.stderr)
        return point

    # -------------------------------------------------------------- export
    def export(self, params) -> Path:
        from eagle_jax.convert.drafter_formats import save_drafter

        dt = _DTYPES[self.cfg.export_dtype] if self.cfg.export_dtype else None
        return save_drafter(self.out / "drafter", self.dcfg, _to_host(params), self.vocab,
                            format=self.cfg.export_format, dtype=dt, overwrite=True)

    def write_model_card(self, summary: dict) -> None:
        cfg, d = self.cfg, self.dcfg
        mi = machine_info()
        ev, ev0 = summary.get("eval"), summary.get("start_eval")
        last = summary.get("last") or {}

        def fmt_eval(e):
            if not e or e.get("tau") is None:
                return "not measured"
            pp = ", ".join(f"{x:.3f}" for x in e["per_position"])
            return (f"tau {e['tau']:.3f} (greedy chain k={e['k']}, {e['prompts']} held-out prompts, "
                    f"{e['max_new_tokens']} new tokens each; per-position acceptance [{pp}])")

        lines = [
            f"# EAGLE drafter for {d.verifier_name_or_path or cfg.target}",
            "",
            f"Variant **{cfg.variant}** ({'fc_norm + norm_output' if d.is_eagle31 else 'EAGLE-3: fc, pre-norm feedback'}), "
            f"trained with eagle-jax's training-time test ({cfg.ttt_length} steps, step weights "
            f"{cfg.step_decay}**i, {cfg.labels} labels).",
            "",
            "## Measured acceptance",
            f"- trained: {fmt_eval(ev)}",
            f"- untrained (step 0): {fmt_eval(ev0)}",
            "",
            "## Data",
            f"- source: {cfg.data}; max conversations {cfg.max_conversations}; held-out fraction "
            f"{cfg.heldout_fraction}",
        ]
        for k, v in self.data_info.items():
            lines.append(f"- {k}: {v}")
        lines += [
            "",
            "## Training",
            f"- steps: {summary['step']} x batch {cfg.batch_size} x seq_len {cfg.seq_len} "
            f"(buckets {cfg.bucket_lengths or 'none'})",
            f"- final loss {last.get('loss', float('nan')):.4f}; per-step top-1 accuracy "
            f"{[round(a, 3) for a in last.get('acc_i', [])]} (last batch)",
            f"- optimiser: AdamW lr {cfg.lr} (warmup {cfg.warmup_steps}, cosine to "
            f"{cfg.lr * cfg.min_lr_ratio:g}), betas ({cfg.beta1}, {cfg.beta2}), weight decay "
            f"{cfg.weight_decay}, grad clip {cfg.grad_clip}",
            f"- compute dtype {cfg.dtype} (target pass {cfg.target_dtype or cfg.dtype}), parameter dtype "
            f"{cfg.param_dtype}, seed {cfg.seed}",
            f"- wall time: {summary['wall_s'] / 3600:.2f} h ({summary['wall_s']:.0f} s); "
            f"first step incl. compile {_seconds(summary.get('compile_s'))}; "
            f"throughput {last.get('tok_s', float('nan')):.0f} tokens/s at the last step (padded); "
            f"{summary['step'] * cfg.batch_size * cfg.seq_len / max(last.get('elapsed_s') or 0, 1e-9):.0f} "
            f"tokens/s over the run",
            f"- machine: {mi['description']}, jax {mi['jax']}",
        ]
        for r in read_log(self.log_path):
            if r.get("type") == "resume":
                what = "; ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in r["changed"].items())
                lines.append(f"- resumed at step {r['step']}" + (f", changed: {what}" if what else ""))
        lines += [
            "",
            "## Drafter",
            f"- hidden {d.hidden_size}, heads {d.num_heads}/{d.num_kv_heads} (head_dim {d.head_dim}), "
            f"FFN {d.intermediate_size}, draft vocab {d.draft_vocab_size} of {d.vocab_size}",
            f"- aux layers (input of target layer i) {list(d.aux_layer_ids)}",
            (f"- init: the drafter at {init_source(cfg)} (its weights and draft vocabulary"
             + (f", from the training state {cfg.resume_from}" if cfg.resume_from else "")
             + (f"; vocabulary widened to {d.draft_vocab_size}, the added ids' head columns mapped from the "
                "target's"
                if self.widened else "")
             + (f"; MLP widened from {self.widened_mlp_from} to {d.intermediate_size} units, the new units' "
                "down-projection rows zero" if self.widened_mlp_from else "") + "); "
             if init_source(cfg) else
             f"- init: random, lm_head = target lm_head rows of the draft vocab, norm = target final norm; ")
            + "embedding shared from the target (not exported)",
            f"- export: {cfg.export_format} format, {cfg.export_dtype or cfg.param_dtype}",
            "",
            "## Full config",
            "```json",
            json.dumps(cfg.to_dict(), indent=2),
            "```",
            "",
        ]
        text = "\n".join(lines)
        (self.out / "model_card.md").write_text(text)
        if (self.out / "drafter").is_dir():
            (self.out / "drafter" / "model_card.md").write_text(text)
