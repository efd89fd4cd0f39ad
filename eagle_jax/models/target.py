"""The Llama-family target decoder (Llama 2/3.x, SmolLM2, Qwen2, Qwen3), with sparse
MoE MLP layers (Qwen3-MoE, DeepSeek-V3: `models.moe`) and multi-head latent attention
(DeepSeek-V3, Kimi K2: `models.mla`, whose cache holds the compressed latents).

`Target` is the model, a Flax NNX module whose parameters (docs/PARAMS.md)
carry their logical axes; decoder layers are stacked on a leading axis and
run under `lax.scan`, or per layer (`unstack_layers`) as an unrolled loop.
One call serves prefill, decode and tree verification: it takes T new
tokens per row with explicit positions and an optional mask among the new
tokens, writes their K/V into the cache, and returns the final residual
stream plus the hidden states entering the requested `aux_layers` (EAGLE's
auxiliary features). A MoE or MLA target (`TargetConfig.per_layer`: its layers
differ in parameters) keeps one dict per layer and runs them unrolled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.cache import KVCache, causal_mask, committed_mask
from eagle_jax.config import TargetConfig
from eagle_jax.kernels import LayerWeight, ops
from eagle_jax.models import mla, moe
from eagle_jax.models.layers import (attend_after_write, param_values,
                                     rotated_heads, set_params, swiglu_mlp)
from eagle_jax.nn import rope_tables

MATMUL_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")  # per-layer projections, [K, N]

# Each parameter's logical axes by leaf name (docs/PARAMS.md layout): the model's own, and
# the decoder layers' (stacked; one layer's drop "layers"). sharding.RULES maps them onto a mesh.
AXES: dict[str, tuple[str, ...]] = {"embed": ("vocab", "embed"), "lm_head": ("embed", "vocab"),
                                    "final_norm": ("embed",)}
LAYER_AXES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("layers", "embed"), "wqkv": ("layers", "embed", "qkv"), "bqkv": ("layers", "qkv"),
    "wo": ("layers", "q_heads", "embed"), "bo": ("layers", "embed"),
    "q_norm": ("layers", "head_dim"), "k_norm": ("layers", "head_dim"),
    "mlp_norm": ("layers", "embed"), "w_gate_up": ("layers", "embed", "ffw2"), "w_down": ("layers", "ffw", "embed"),
    # MLA (models/mla.py)
    "wqkv_a": ("layers", "embed", "mla_a"), "q_a_norm": ("layers", "q_lora"), "wq_b": ("layers", "q_lora", "mla_q"),
    "kv_a_norm": ("layers", "kv_lora"), "wkv_b": ("layers", "kv_lora", "mla_kv"),
    # MoE (models/moe.py)
    "router": ("layers", "embed", "expert_scores"), "router_bias": ("layers", "expert_scores"),
    "experts_gate_up": ("layers", "experts", "embed", "expert_ffw2"),
    "experts_down": ("layers", "experts", "expert_ffw", "embed"),
    "shared_gate_up": ("layers", "embed", "ffw2"), "shared_down": ("layers", "ffw", "embed"),  # a dense MLP's
}


def create_cache(cfg: TargetConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """Per-head K/V [L, B, Hkv, S, D]; for MLA the latents and rope keys (`mla.create_cache`)."""
    if cfg.mla is not None:
        return mla.create_cache(cfg.mla, cfg.num_layers, batch, max_len, dtype)
    return KVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, dtype)


def per_layer(layers) -> bool:
    """Whether `layers` holds one dict per layer keyed by its index (`unstack_layers`),
    not stacked arrays."""
    return bool(layers) and all(isinstance(k, int) for k in layers)


def unstack_layers(params):
    """Stacked `layers` (dict of [L, ...]) -> L per-layer dicts keyed 0 .. L-1 (the
    layout Flax gives the state of a module's `nnx.List`), each its own buffer.
    `Target` then runs the layers as an unrolled Python loop
    instead of `lax.scan`: on CPU, scan copies every layer's weights out of the
    stacked arrays each step (a decode step ~1.5x slower), while separate buffers
    feed the matmuls directly. Costs a longer compile; outputs are identical."""
    layers = params["layers"]
    if per_layer(layers):
        return params
    # Through host memory: one copy per array, where eager device slicing
    # compiles and dispatches one op per (leaf, layer).
    host = jax.tree.map(np.asarray, layers)
    num = jax.tree.leaves(host)[0].shape[0]
    return {**params, "layers": {i: jax.tree.map(lambda x, i=i: jnp.asarray(x[i]), host) for i in range(num)}}


def pack_for_cpu(params, cfg: TargetConfig):
    """Pack every projection (and the lm_head, the transposed embedding when
    tied) for the native CPU kernels, all in one host block; stacked or
    per-layer `layers` alike."""
    layers = params["layers"]
    parts = layers if per_layer(layers) else {None: layers}
    weights = [x for layer in parts.values() for name, x in layer.items() if name in MATMUL_WEIGHTS]
    packed = iter(ops.pack_weights([*weights, Target(cfg, params).lm_head_weight()]))
    parts = {i: {name: next(packed) if name in MATMUL_WEIGHTS else x for name, x in layer.items()}
             for i, layer in parts.items()}
    return {**params, "layers": parts if per_layer(layers) else parts[None], "lm_head": next(packed)}


def prepare_for_decoding(params, cfg: TargetConfig, *, impl: str = "auto", unroll: bool | None = None):
    """The parameters the decoding loop runs on: per-layer buffers on CPU
    (`unstack_layers`, unless `unroll` says otherwise); when `impl` resolves
    to the native CPU kernels, packed projections (`pack_for_cpu`); for the
    Pallas kernels, which take W as [K, N], a tied lm_head made once as the
    transposed embedding (else every step would transpose the embedding)."""
    if unroll is None:
        unroll = jax.default_backend() == "cpu"
    if unroll:
        params = unstack_layers(params)
    resolved = ops.resolve(impl)
    if resolved == "native":
        return pack_for_cpu(params, cfg)
    if resolved == "pallas" and cfg.tie_word_embeddings and "lm_head" not in params:
        return {**params, "lm_head": jnp.asarray(params["embed"].T)}
    return params


class TargetLayer(nnx.Module):
    """A decoder layer's weights (docs/PARAMS.md `layers`), each an `nnx.Param`
    carrying its logical axes (`LAYER_AXES`): one layer's, or all layers'
    stacked on a leading `layers` axis (then `weights(i)` picks one)."""

    def __init__(self, weights: dict, *, stacked: bool):
        self.stacked = stacked
        set_params(self, weights, LAYER_AXES, drop=0 if stacked else 1)

    def weights(self, i=None) -> dict:
        """{leaf name: value}; of stacked weights, layer i (traced): each [L, K, N]
        projection as a `LayerWeight` (the Pallas kernels read it in place; XLA
        indexes it), the rest (norm gains, biases, packed weights) indexed."""
        values = param_values(self)
        if not self.stacked:
            return values
        return {name: LayerWeight(x, i) if name in MATMUL_WEIGHTS and isinstance(x, jax.Array)
                else jax.tree.map(lambda a: a[i], x) for name, x in values.items()}

    def __call__(self, cfg: TargetConfig, h, cos, sin, cache, i, new_mask, native, impl):
        """Layer i: h [B,T,H] -> (h, cache with the layer's new K/V written). i is a
        Python int where `cfg.per_layer` (the layer's kind depends on it)."""
        p = self.weights(i)
        if cfg.mla is not None:
            h, cache = mla.mla_attention(p, cfg, h, cos, sin, cache, i, new_mask, impl=impl)
        else:
            qkv = ops.fused_norm_matmul(h, p["attn_norm"], p["wqkv"], eps=cfg.rms_norm_eps,
                                        bias=p.get("bqkv"), impl=impl)
            attn, cache = _attend(p, cfg, qkv, cos, sin, cache, i, new_mask, native, impl)
            h = ops.matmul(attn.reshape(*h.shape[:2], -1), p["wo"], p.get("bo"), residual=h, impl=impl)
        if cfg.moe is not None and i in cfg.moe.layers:
            return moe.moe_mlp(p, cfg, h, impl=impl), cache
        h = swiglu_mlp(h, p["mlp_norm"], p["w_gate_up"], p["w_down"], eps=cfg.rms_norm_eps,
                       groups=cfg.fused_groups, impl=impl)
        return h, cache


def _attend(p, cfg: TargetConfig, qkv, cos, sin, cache: KVCache, i, new_mask, native: bool, impl):
    """Layer i's attention over the committed cache slots plus the new keys,
    which it stores at slots lengths + t: qkv [B,T,(Hq+2Hkv)*D] -> (out
    [B,T,Hq,D], cache). The native kernel rotates q/k itself, reads the live
    slots straight from the whole cache and stores the new K/V in place; the
    XLA path writes them first and attends over the written cache
    (`attend_after_write`)."""
    if native:
        qk_norm = (p["q_norm"], p["k_norm"]) if "q_norm" in p else None
        out, k_cache, v_cache = ops.attention(qkv, cos, sin, cache.k, cache.v, i, cache.lengths, new_mask,
                                              num_heads=cfg.num_heads, qk_norm=qk_norm, eps=cfg.rms_norm_eps)
        return out.astype(qkv.dtype), cache.replace(k=k_cache, v=v_cache)
    q, k, v = rotated_heads(cfg, qkv, cos, sin, q_norm=p.get("q_norm"), k_norm=p.get("k_norm"),
                            eps=cfg.rms_norm_eps)
    cache_mask = committed_mask(cache.lengths, cache.max_len, q.shape[1])
    return attend_after_write(q, k, v, cache, i, cache_mask, new_mask, impl=impl)


class Target(nnx.Module):
    """The target decoder as a Flax NNX module, built from its parameters in
    the layout of docs/PARAMS.md (`Target(cfg, params)`: stacked or per-layer
    `layers`, plain or packed projections), which is its pure state
    (`nnx.to_pure_dict(nnx.state(model))` gives the same dict back). The jitted
    loop and the trainer pass that dict through `jit` and build the module inside
    the trace: `jit` flattens a module several times slower than a dict of the
    same arrays, on every call of a step."""

    def __init__(self, cfg: TargetConfig, params: dict):
        self.cfg = cfg
        layers = params["layers"]
        if per_layer(layers):
            if sorted(layers) != list(range(cfg.num_layers)):
                raise ValueError(f"per-layer params hold layers {sorted(layers)}, the config 0 .. {cfg.num_layers - 1}")
            self.layers = nnx.List([TargetLayer(layers[i], stacked=False) for i in range(cfg.num_layers)])
        elif cfg.per_layer:
            raise ValueError("a MoE or MLA target takes one parameter dict per layer, not stacked layers")
        else:
            self.layers = TargetLayer(layers, stacked=True)
        set_params(self, {name: x for name, x in params.items() if name != "layers"}, AXES)

    def __call__(self, tokens, positions, cache: KVCache, mask=None, *, aux_layers: tuple[int, ...] = (),
                 impl: str = "auto"):
        """Run the decoder over T new tokens per row.

        tokens, positions: [B, T] int32. mask: None (causal among the new tokens)
        or [B, T, T] bool. Committed cache slots are always visible.
        Per-layer `layers` run as an unrolled loop, stacked ones under `lax.scan`.
        Returns (hidden [B, T, H] before the final norm, cache with K/V written
        but lengths unchanged, aux [B, T, len(aux_layers) * H] or None), where aux
        concatenates the residual streams entering `aux_layers` in the given order.
        """
        cfg = self.cfg
        b, t = tokens.shape
        for layer_id in aux_layers:
            if not 0 <= layer_id < cfg.num_layers:
                raise ValueError(f"aux layer {layer_id} outside [0, {cfg.num_layers})")
        if cfg.mla is not None and ops.is_native(impl):
            raise ValueError("an MLA target runs on the XLA or Pallas impls: the native CPU kernels "
                             "take per-head K/V caches (pass impl='xla')")
        h = ops.embed(self.embed.get_value(), tokens, impl=impl)
        cos, sin = rope_tables(positions, cfg.rope, cfg.head_dim)
        new_mask = causal_mask(b, t) if mask is None else mask
        # Prefill chunks (long T) attend through XLA: the native kernel is built for decode and verify.
        native = ops.attends_natively(impl, t, cfg.head_dim, cfg.fused_groups)

        if isinstance(self.layers, nnx.List):
            entering = []  # entering[i]: the residual stream into layer i
            for i, layer in enumerate(self.layers):
                entering.append(h)
                h, cache = layer(cfg, h, cos, sin, cache, i, new_mask, native, impl)
            aux = [entering[i] for i in aux_layers]
        else:
            aux_ids = jnp.asarray(aux_layers if aux_layers else (-1,), jnp.int32)
            aux0 = jnp.zeros((len(aux_layers) or 1, b, t, cfg.hidden_size), h.dtype)

            def layer_body(carry, i):
                h, aux, cache = carry
                aux = jnp.where((aux_ids == i)[:, None, None, None], h[None], aux)
                h, cache = self.layers(cfg, h, cos, sin, cache, i, new_mask, native, impl)
                return (h, aux, cache), None

            layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            (h, aux, cache), _ = jax.lax.scan(layer_body, (h, aux0, cache), layer_ids)
            aux = list(aux)
        if not aux_layers:
            return h, cache, None
        return h, cache, jnp.concatenate(aux, axis=-1)

    def lm_head_weight(self):
        """[H, V]: the output projection (when tied: made by `prepare_for_decoding`,
        packed or not), else the transposed embedding when tied."""
        if self.cfg.tie_word_embeddings and not hasattr(self, "lm_head"):
            return self.embed.get_value().T
        return self.lm_head.get_value()

    def logits(self, hidden, *, impl: str = "auto") -> jax.Array:
        """Final norm + lm_head (fused): hidden [..., H] -> float32 [..., V]."""
        return ops.fused_norm_matmul(hidden, self.final_norm.get_value(), self.lm_head_weight(),
                                     eps=self.cfg.rms_norm_eps, impl=impl, out_dtype=jnp.float32)


def init_params(cfg: TargetConfig, key, dtype=jnp.float32, scale: float = 0.02):
    """Random parameters in the layout of docs/PARAMS.md (tests and tiny targets)."""
    if cfg.per_layer:
        return _init_per_layer(cfg, key, dtype, scale)
    h, f, l = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qkv = cfg.q_size + 2 * cfg.kv_size
    keys = iter(jax.random.split(key, 16))

    def w(*shape):
        return (scale * jax.random.normal(next(keys), shape)).astype(dtype)

    def ones_ish(*shape):
        return (1.0 + 0.1 * jax.random.normal(next(keys), shape)).astype(dtype)

    layers = {"attn_norm": ones_ish(l, h), "wqkv": w(l, h, qkv), "wo": w(l, cfg.q_size, h),
              "mlp_norm": ones_ish(l, h), "w_gate_up": w(l, h, 2 * f), "w_down": w(l, f, h)}
    if cfg.qkv_bias:
        layers["bqkv"] = w(l, qkv)
    if cfg.o_bias:
        layers["bo"] = w(l, h)
    if cfg.qk_norm:
        layers["q_norm"] = ones_ish(l, cfg.head_dim)
        layers["k_norm"] = ones_ish(l, cfg.head_dim)
    params = {"embed": w(cfg.vocab_size, h), "layers": layers, "final_norm": ones_ish(h)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = w(h, cfg.vocab_size)
    return params


def _init_per_layer(cfg: TargetConfig, key, dtype, scale: float):
    """`init_params` of a MoE or MLA target: one dict per layer. The router's
    correction bias is random too, so that it changes which experts are chosen."""
    h, l = cfg.hidden_size, cfg.num_layers
    keys = iter(jax.random.split(key, 16 * l + 4))

    def w(*shape, dt=dtype, s=scale):
        return (s * jax.random.normal(next(keys), shape)).astype(dt)

    def ones_ish(*shape):
        return (1.0 + 0.1 * jax.random.normal(next(keys), shape)).astype(dtype)

    def layer(i):
        p = {"attn_norm": ones_ish(h), "mlp_norm": ones_ish(h)}
        if cfg.mla is None:
            p.update(wqkv=w(h, cfg.q_size + 2 * cfg.kv_size), wo=w(cfg.q_size, h))
            if cfg.qk_norm:
                p.update(q_norm=ones_ish(cfg.head_dim), k_norm=ones_ish(cfg.head_dim))
        else:
            m, heads = cfg.mla, cfg.num_heads
            q_a = m.q_lora_rank or heads * m.qk_head_dim
            p.update(wqkv_a=w(h, q_a + m.kv_lora_rank + m.qk_rope_head_dim), kv_a_norm=ones_ish(m.kv_lora_rank),
                     wkv_b=w(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)),
                     wo=w(heads * m.v_head_dim, h))
            if m.q_lora_rank is not None:
                p.update(q_a_norm=ones_ish(q_a), wq_b=w(q_a, heads * m.qk_head_dim))
        if cfg.moe is None or i not in cfg.moe.layers:
            p.update(w_gate_up=w(h, 2 * cfg.intermediate_size), w_down=w(cfg.intermediate_size, h))
            return p
        e, f = cfg.moe.num_experts, cfg.moe.intermediate_size
        p.update(router=w(h, e, dt=jnp.float32, s=1.0), experts_gate_up=w(e, h, 2 * f), experts_down=w(e, f, h))
        if cfg.moe.scoring == "sigmoid":
            p["router_bias"] = w(e, dt=jnp.float32, s=0.1)
        if cfg.moe.num_shared_experts:
            fs = cfg.moe.shared_intermediate_size
            p.update(shared_gate_up=w(h, 2 * fs), shared_down=w(fs, h))
        return p

    params = {"embed": w(cfg.vocab_size, h), "layers": {i: layer(i) for i in range(l)}, "final_norm": ones_ish(h)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = w(h, cfg.vocab_size)
    return params
