"""The EAGLE-3 / EAGLE 3.1 drafter: an FC over target features and one decoder layer.

`Drafter` is the model, a Flax NNX module whose parameters (docs/PARAMS.md)
carry their logical axes. A drafting step is split in two:

* `Drafter.project_features(aux)`: target aux features [B, T, A*Ht] ->
  drafter hidden [B, T, H] through the FC (with `fc_norm` or `norm_before_fc`
  when configured). Used where the drafter reads the target (prefill and the
  tokens just verified).
* `Drafter.step(tokens, hidden, positions, cache, ...)`: the decoder layer
  over T new positions whose hidden input is either projected target features
  or the previous step's feedback. Returns draft-vocab logits, the feedback
  (pre-norm for EAGLE-3, post-norm with `norm_output`) and the cache.

The same step serves chain drafting (T = 1 per row), tree drafting (T
frontier nodes with a tree `mask`) and the training-time-test unroll (a
`slot_mask` over all cache slots).

A parallel drafter (P-EAGLE, `DrafterConfig.mask_token_id` set) has one more
parameter, `mask_hidden` [A*Ht], and `draft_parallel` proposes a whole chain in
one forward: the real entries, then k - 1 placeholder slots.

An MLA drafter (`DrafterConfig.mla` set: vLLM's `Eagle3DeepseekV2ForCausalLM`, the
Kimi K2.x drafters) is the same layer with `models.mla`'s attention: its [q_a | kv_a]
projection `wqkv_a` reads concat(input_layernorm(e), hidden_norm(h)) where the
q/k/v projection would, and its cache holds the compressed latents and rope keys
(`mla.create_cache`). It runs on the XLA and Pallas impls, as an MLA target does.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.cache import KVCache, causal_mask, committed_mask
from eagle_jax.config import DrafterConfig
from eagle_jax.kernels import ops
from eagle_jax.models import mla
from eagle_jax.models.layers import (attend_after_write, param_values,
                                     rotated_heads, set_params, swiglu_mlp)
from eagle_jax.nn import rms_norm, rope_tables
from eagle_jax.sharding import RULES

# Each parameter's logical axes by leaf name (docs/PARAMS.md layout): the model's own, and
# its decoder `layer`'s. sharding.RULES maps them onto a mesh.
AXES: dict[str, tuple[str, ...]] = {
    "fc": ("aux", "embed"), "fc_norm": ("aux_states", "target_embed"), "input_norm": ("aux",),
    "norm": ("embed",), "lm_head": ("embed", "draft_vocab"), "embed": ("vocab", "embed"),
    "mask_hidden": ("aux",),
}
LAYER_AXES: dict[str, tuple[str, ...]] = {
    "input_layernorm": ("embed",), "hidden_norm": ("embed",), "post_attention_layernorm": ("embed",),
    "wqkv": ("embed2", "qkv"), "bqkv": ("qkv",), "wo": ("q_heads", "embed"), "bo": ("embed",),
    "w_gate_up": ("embed", "ffw2"), "w_down": ("ffw", "embed"),
    # MLA (models/mla.py)
    "wqkv_a": ("embed2", "mla_a"), "q_a_norm": ("q_lora",), "wq_b": ("q_lora", "mla_q"),
    "kv_a_norm": ("kv_lora",), "wkv_b": ("kv_lora", "mla_kv"),
}
_FC_COLUMNS = RULES[AXES["fc"][-1]]  # the mesh axis of fc's columns (None: replicated)


@flax.struct.dataclass
class DraftVocab:
    """Draft-to-target vocabulary map (EAGLE.md section 3), never trained.

    d2t: int32 [Vd] offsets, target_id = draft_id + d2t[draft_id].
    t2d: bool [V], True where a target id is in the draft vocabulary.
    """

    d2t: jax.Array
    t2d: jax.Array

    @classmethod
    def identity(cls, vocab_size: int) -> "DraftVocab":
        return cls(d2t=jnp.zeros((vocab_size,), jnp.int32), t2d=jnp.ones((vocab_size,), bool))

    @classmethod
    def from_target_ids(cls, target_ids, vocab_size: int) -> "DraftVocab":
        """target_ids [Vd] sorted ascending -> offsets and mask."""
        ids = jnp.asarray(target_ids, jnp.int32)
        return cls(d2t=ids - jnp.arange(ids.shape[0], dtype=jnp.int32),
                   t2d=jnp.zeros((vocab_size,), bool).at[ids].set(True))

    @property
    def target_ids(self) -> jax.Array:
        """[Vd] int32: the target id of each draft id."""
        return jnp.arange(self.d2t.shape[0], dtype=jnp.int32) + self.d2t


def create_cache(cfg: DrafterConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """Per-head K/V [1, B, Hkv, S, D]; for MLA the latents and rope keys (`mla.create_cache`)."""
    if cfg.mla is not None:
        return mla.create_cache(cfg.mla, 1, batch, max_len, dtype)
    return KVCache.create(1, batch, max_len, cfg.num_kv_heads, cfg.head_dim, dtype)


def prepare_for_decoding(params, *, impl: str = "auto"):
    """Pack the projections for the native CPU kernels when `impl` resolves to them."""
    if not ops.is_native(impl):
        return params
    names = [name for name in params["layer"] if name in ("wqkv", "wo", "w_gate_up", "w_down")]
    *projections, fc, lm_head = ops.pack_weights([*(params["layer"][n] for n in names), params["fc"],
                                                  params["lm_head"]])
    return {**params, "layer": {**params["layer"], **dict(zip(names, projections))}, "fc": fc,
            "lm_head": lm_head}


class DrafterLayer(nnx.Module):
    """The drafter's decoder layer weights (docs/PARAMS.md `layer`), each an
    `nnx.Param` carrying its logical axes (`LAYER_AXES`)."""

    def __init__(self, weights: dict):
        set_params(self, weights, LAYER_AXES)


class Drafter(nnx.Module):
    """The drafter as a Flax NNX module, built from its parameters in the
    layout of docs/PARAMS.md (`Drafter(cfg, params)`, plain or packed
    projections), which is its pure state; jitted code passes that dict and
    builds the module inside the trace, as for `target.Target`."""

    def __init__(self, cfg: DrafterConfig, params: dict):
        self.cfg = cfg
        self.layer = DrafterLayer(params["layer"])
        set_params(self, {name: x for name, x in params.items() if name != "layer"}, AXES)

    def project_features(self, aux: jax.Array, *, impl: str = "auto") -> jax.Array:
        """aux [B, T, A*Ht] (aux states concatenated in layer order) -> [B, T, H]."""
        cfg = self.cfg
        if aux.shape[-1] != cfg.fc_in_size:
            raise ValueError(f"drafter expects {cfg.num_aux} aux states of size {cfg.target_hidden_size} "
                             f"({cfg.fc_in_size} features), got {aux.shape[-1]}")
        if cfg.fc_norm:
            return ops.fused_norm_matmul(aux, self.fc_norm.get_value(), self.fc.get_value(), eps=cfg.rms_norm_eps,
                                         segments=cfg.num_aux, impl=impl, column_axis=_FC_COLUMNS)
        if cfg.norm_before_fc:
            return ops.fused_norm_matmul(aux, self.input_norm.get_value(), self.fc.get_value(), eps=cfg.rms_norm_eps,
                                         impl=impl, column_axis=_FC_COLUMNS)
        return ops.matmul(aux, self.fc.get_value(), impl=impl)

    def layer_forward(self, tokens, hidden, positions, attend, *, embed=None, impl: str = "auto"):
        """The decoder layer with the attention supplied by
        `attend(qkv, cos, sin) -> (out [B, T, Hq*D], extra)`: it gets the fused
        projection and the RoPE tables (`layers.rotated_heads` splits and rotates them;
        for MLA, qkv is the [q_a | kv_a] projection and out [B, T, h*Dv]).
        Shared by the call (extra: the cache with the new K/V written) and the
        training-time-test unroll (train/ttt.py, extra: the rotated k and v),
        which attends differently.

        Returns (h [B, T, H] before the final norm, extra).
        """
        cfg = self.cfg
        layer = param_values(self.layer)
        eps = cfg.rms_norm_eps
        if cfg.has_embedding:
            embed = self.embed.get_value()
        elif embed is None:
            raise ValueError("this drafter has no embed_tokens: pass the target's embedding as embed=")
        e = ops.embed(embed, tokens, impl=impl).astype(hidden.dtype)
        residual = rms_norm(hidden, layer["hidden_norm"], eps) if cfg.norm_before_residual else hidden
        # q/k/v (MLA: q_a/kv_a) read concat(input_layernorm(e), hidden_norm(hidden)): two normalised segments.
        norms = jnp.stack([layer["input_layernorm"], layer["hidden_norm"]])
        qkv = ops.fused_norm_matmul(jnp.concatenate([e, hidden], axis=-1), norms,
                                    layer["wqkv" if cfg.mla is None else "wqkv_a"], eps=eps,
                                    segments=2, bias=layer.get("bqkv"), impl=impl)
        cos, sin = rope_tables(positions, cfg.rope, cfg.head_dim)
        out, extra = attend(qkv, cos, sin)
        h = ops.matmul(out, layer["wo"], layer.get("bo"), residual=residual, impl=impl)
        h = swiglu_mlp(h, layer["post_attention_layernorm"], layer["w_gate_up"], layer["w_down"], eps=eps,
                       groups=cfg.fused_groups, impl=impl)
        return h, extra

    def head(self, h, *, impl: str = "auto"):
        """h [..., H] -> (draft logits float32 [..., Vd], feedback [..., H]).

        The feedback is h itself (EAGLE-3) or norm(h) with `norm_output` (EAGLE 3.1).
        """
        cfg = self.cfg
        norm = self.norm.get_value()
        logits = ops.fused_norm_matmul(h, norm, self.lm_head.get_value(), eps=cfg.rms_norm_eps, impl=impl,
                                       out_dtype=jnp.float32)
        feedback = rms_norm(h, norm, cfg.rms_norm_eps) if cfg.norm_output else h
        return logits, feedback

    def __call__(self, tokens, hidden, positions, cache: KVCache, *, embed=None, mask=None, slot_mask=None,
                 impl: str = "auto"):
        """One drafter layer pass over T new positions per row, without the head.

        tokens [B, T] int32 (target ids: the token *after* each position), hidden
        [B, T, H], positions [B, T]. `mask` [B, T, T] among the new tokens (causal
        when None); `slot_mask` [B, T, S] over the cache slots written before this
        call (default: the committed ones; it must not cover the T slots this call
        writes, from `cache.lengths` on: `mask` decides what of those each query
        sees). `embed` [V, H] is the target's embedding, required when the
        checkpoint has none.
        With `cfg.sliding_window` both masks also drop keys at or before
        position - window (a cache slot's position is its index).
        Returns (h [B, T, H], the layer's output before the final norm, and the
        cache); `head(h)` gives the draft logits and the feedback.

        The new K/V are written at slots `cache.lengths + t` but not committed: the
        returned cache has the same `lengths`, and the caller commits what it keeps
        (`cache.commit`, `cache.compact`), as the target does. With the
        native CPU kernels (decoding) the step has no gradient; differentiate it
        with impl="xla".
        """
        cfg = self.cfg
        b, t = tokens.shape
        if cfg.mla is not None and ops.is_native(impl):
            raise ValueError("an MLA drafter runs on the XLA or Pallas impls: the native CPU kernels "
                             "take per-head K/V caches (pass impl='xla')")
        committed_only = slot_mask is None and cfg.sliding_window is None  # the native kernel's default
        if slot_mask is None:
            slot_mask = committed_mask(cache.lengths, cache.max_len, t)
        new_mask = causal_mask(b, t) if mask is None else mask
        if cfg.sliding_window is not None:
            slot_mask, new_mask = window_masks(slot_mask, new_mask, positions, cfg.sliding_window)

        # The native kernel reads the cache in place and writes the new K/V into
        # it in the same call: one chain of in-place updates, no copy of the cache.
        native = ops.attends_natively(impl, t, cfg.head_dim, cfg.fused_groups)

        def attend(qkv, cos, sin):
            if cfg.mla is not None:
                return mla.latent_attention_block(param_values(self.layer), cfg, qkv, cos, sin, cache, 0, slot_mask,
                                                  new_mask, impl=impl)
            if native:
                out, k_cache, v_cache = ops.attention(qkv, cos, sin, cache.k, cache.v, 0, cache.lengths, new_mask,
                                                      num_heads=cfg.num_heads,
                                                      slot_mask=None if committed_only else slot_mask)
                return out.astype(qkv.dtype).reshape(b, t, -1), cache.replace(k=k_cache, v=v_cache)
            q, k, v = rotated_heads(cfg, qkv, cos, sin)
            out, written = attend_after_write(q, k, v, cache, 0, slot_mask, new_mask, impl=impl)
            return out.reshape(b, t, -1), written

        return self.layer_forward(tokens, hidden, positions, attend, embed=embed, impl=impl)

    def step(self, tokens, hidden, positions, cache: KVCache, *, embed=None, mask=None, slot_mask=None,
             logits_at=None, impl: str = "auto"):
        """The call, then the head: (draft logits float32 [B, T, Vd], feedback
        [B, T, H], cache). `logits_at` [B] int32 computes the logits at one
        position per row only (then [B, 1, Vd])."""
        h, cache = self(tokens, hidden, positions, cache, embed=embed, mask=mask, slot_mask=slot_mask, impl=impl)
        logits, _ = self.head(h if logits_at is None else
                              jnp.take_along_axis(h, logits_at[:, None, None], axis=1), impl=impl)
        _, feedback = self.head(h, impl=impl) if self.cfg.norm_output else (None, h)
        return logits, feedback, cache


def draft_parallel(cfg: DrafterConfig, params: dict, vocab: DraftVocab, tokens, aux, cache: KVCache, k: int, *,
                   num_new=None, embed=None, impl: str = "auto"):
    """P-EAGLE: one drafter forward proposing a chain of k tokens (vLLM's parallel drafting).

    tokens [B, T] int32 and aux [B, T, A*Ht] are new context entries as `Drafter.__call__`
    pairs them (tokens[:, j] is the token after the position of aux[:, j]), at cache slots
    and positions cache.lengths + j; num_new [B] int32 in [1, T] (default T) says how many
    are real in each row. The last real one (column num_new - 1: the last accepted token
    with the target's features of the position before it, the root of `spec_decode/tree.py`)
    proposes token 1. After it come k - 1 placeholder slots at the next positions: token
    `cfg.mask_token_id`, features `mask_hidden` (through the same norm and fc as target
    features); slot i proposes token i + 1. The attention is plain causal attention over
    the committed cache and the new slots, so a slot sees the context, the real entries and
    the placeholders before it (vLLM's `PEagleSpeculator`). The cache needs
    cache.lengths + T + k - 1 <= max_len slots.

    Returns (tokens [B, k] int32 target ids of the greedy chain, its logits float32
    [B, k, Vd], the cache with the T + k - 1 new K/V written from cache.lengths on, none
    committed: the caller commits the num_new real entries; the placeholders' K/V are
    scratch that the next roll-forward overwrites).
    """
    if not cfg.parallel_drafting:
        raise ValueError("draft_parallel needs a parallel drafter (DrafterConfig.mask_token_id is None)")
    if "mask_hidden" not in params:
        raise ValueError("this parallel drafter's parameters have no mask_hidden")
    if k < 1:
        raise ValueError(f"a chain has k >= 1 tokens, got {k}")
    b, t = tokens.shape
    width = t + k - 1
    n = jnp.full((b,), t, jnp.int32) if num_new is None else jnp.asarray(num_new, jnp.int32)
    cols = jnp.arange(width, dtype=jnp.int32)[None]
    real = cols < n[:, None]  # [B, W]; the rest are placeholders (those past n + k - 1 read by no one)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, k - 1)] + [(0, 0)] * (x.ndim - 2))
    model = Drafter(cfg, params)
    feats = jnp.where(real[..., None], pad(aux), model.mask_hidden.get_value().astype(aux.dtype))
    ids = jnp.where(real, pad(tokens), cfg.mask_token_id)
    h, cache = model(ids, model.project_features(feats, impl=impl), cache.lengths[:, None] + cols, cache,
                     embed=embed, impl=impl)
    at = n[:, None] - 1 + jnp.arange(k, dtype=jnp.int32)[None]  # [B, k]: the root, then the placeholders
    logits, _ = model.head(jnp.take_along_axis(h, at[..., None], axis=1), impl=impl)
    return vocab.target_ids[ops.argmax(logits, impl=impl)], logits, cache


def window_masks(slot_mask, new_mask, positions, window: int):
    """Restrict slot_mask [B, T, S] and new_mask [B, T, T] to keys at positions in
    (p - window, p] for a query at position p. Slot s is taken to hold position s,
    as committed context does; drafted tree nodes sit at or past their positions,
    all within one tree depth of the query, so the rule is exact whenever the
    window exceeds the draft depth."""
    low = positions[:, :, None] - window  # [B, T, 1]
    slots = jnp.arange(slot_mask.shape[-1], dtype=positions.dtype)[None, None, :]
    return slot_mask & (slots > low), new_mask & (positions[:, None, :] > low)


def to_target_logits(draft_logits: jax.Array, vocab: DraftVocab) -> jax.Array:
    """Scatter draft-vocab logits [..., Vd] into a -inf target-vocab vector [..., V]."""
    full = jnp.full(draft_logits.shape[:-1] + vocab.t2d.shape, -jnp.inf, draft_logits.dtype)
    return full.at[..., vocab.target_ids].set(draft_logits)


def init_params(cfg: DrafterConfig, key, dtype=jnp.float32, scale: float = 0.02):
    """Random parameters in the layout of docs/PARAMS.md."""
    h, f, ht = cfg.hidden_size, cfg.intermediate_size, cfg.target_hidden_size
    keys = iter(jax.random.split(key, 20))

    def w(*shape):
        return (scale * jax.random.normal(next(keys), shape)).astype(dtype)

    def ones_ish(*shape):
        return (1.0 + 0.1 * jax.random.normal(next(keys), shape)).astype(dtype)

    if cfg.mla is None:
        qkv = cfg.q_size + 2 * cfg.kv_size
        layer = {"input_layernorm": ones_ish(h), "hidden_norm": ones_ish(h), "wqkv": w(2 * h, qkv),
                 "wo": w(cfg.q_size, h)}
    else:
        m, heads = cfg.mla, cfg.num_heads
        q_a = m.q_lora_rank or heads * m.qk_head_dim
        layer = {"input_layernorm": ones_ish(h), "hidden_norm": ones_ish(h),
                 "wqkv_a": w(2 * h, q_a + m.kv_lora_rank + m.qk_rope_head_dim), "kv_a_norm": ones_ish(m.kv_lora_rank),
                 "wkv_b": w(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)),
                 "wo": w(heads * m.v_head_dim, h)}
        if m.q_lora_rank is not None:
            layer.update(q_a_norm=ones_ish(q_a), wq_b=w(q_a, heads * m.qk_head_dim))
    layer.update(post_attention_layernorm=ones_ish(h), w_gate_up=w(h, 2 * f), w_down=w(f, h))
    if cfg.qkv_bias:
        layer["bqkv"] = w(qkv)
    if cfg.o_bias:
        layer["bo"] = w(h)
    params = {"fc": w(cfg.fc_in_size, h), "layer": layer, "norm": ones_ish(h),
              "lm_head": w(h, cfg.draft_vocab_size)}
    if cfg.fc_norm:
        params["fc_norm"] = ones_ish(cfg.num_aux, ht)
    if cfg.norm_before_fc:
        params["input_norm"] = ones_ish(cfg.fc_in_size)
    if cfg.has_embedding:
        params["embed"] = w(cfg.vocab_size, h)
    if cfg.parallel_drafting:
        params["mask_hidden"] = init_mask_hidden(cfg, next(keys), dtype)
    return params


def init_mask_hidden(cfg: DrafterConfig, key, dtype=jnp.float32) -> jax.Array:
    """A fresh placeholder feature vector [A*Ht], normal(0, 1): unit RMS in every aux
    slot, the scale `fc_norm` gives target features (a zero vector would put the
    RMSNorms at their singular point)."""
    return jax.random.normal(key, (cfg.fc_in_size,)).astype(dtype)
