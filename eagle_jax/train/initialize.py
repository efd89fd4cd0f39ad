"""The drafter a run starts from: its config from the target's and the run's settings, and its
weights, random or from a checkpoint (widened where the run asks for more).

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
``resume_from`` (a committed training state, train/state.py) starts from the
state's drafter the same way (`init_source`). The embedding is the target's
``embed``: it is no parameter of the drafter (``has_embedding`` stays False).
A parallel drafter (``parallel_drafting``) started from a sequential one gets a
fresh ``mask_hidden`` (``drafter.init_mask_hidden``); every other weight is the
sequential drafter's, so its first proposed token is exactly that drafter's.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.config import ConfigError, DrafterConfig, TargetConfig
from eagle_jax.models import drafter, target
from eagle_jax.train.config import VARIANTS, TrainConfig

__all__ = ["build_drafter_config", "init_drafter_params", "load_init_drafter", "widen_lm_head", "widen_mlp",
           "init_source"]


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
        speculative_tokens=cfg.ttt_length if cfg.parallel_drafting else cfg.eval_k,
        mask_token_id=cfg.mask_token_id if cfg.parallel_drafting else None,
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
    (`widen_lm_head`, `widen_mlp`); a sequential drafter started as a parallel one has no
    `mask_hidden` yet (the run adds one, `drafter.init_mask_hidden`)."""
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
    if lcfg.parallel_drafting and lcfg.mask_token_id != dcfg.mask_token_id:
        raise ConfigError(f"init_from {path}: its placeholder token is {lcfg.mask_token_id} "
                          f"(config: {dcfg.mask_token_id if dcfg.parallel_drafting else 'not a parallel drafter'})")
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
