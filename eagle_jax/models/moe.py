"""The sparse mixture-of-experts MLP block (Qwen3-MoE; DeepSeek-V3 and Kimi K2 with
shared experts, sigmoid scoring, the correction bias and grouped choice).

Layer parameters (docs/PARAMS.md, one layer's): `router` [H, E] and, for sigmoid
scoring, `router_bias` [E] (both float32 whatever the model's dtype, as
transformers and vLLM keep DeepSeek's gate); `experts_gate_up` [E, H, 2I] ([gate |
up] per expert), `experts_down` [E, I, H]; with shared experts `shared_gate_up`
[H, 2Is] and `shared_down` [Is, H].

The experts run as two grouped matmuls (`jax.lax.ragged_dot`) over the token-expert
pairs sorted by expert: each pair is multiplied by its own expert's weights only.
(XLA:CPU lowers a grouped matmul to a masked dense one over every expert; TPU and
GPU have grouped kernels.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax.config import MoEConfig, TargetConfig
from eagle_jax.kernels import ops
from eagle_jax.nn import rms_norm

FLOAT32_PARAMS = ("router", "router_bias")  # kept in float32 whatever the model's dtype


def route(moe: MoEConfig, x, router, bias=None):
    """Each token's experts and their weights: x [N, H] -> (weights [N, k] float32,
    experts [N, k] int32), k = moe.experts_per_token (see `MoEConfig`)."""
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))  # [N, E]
    k = moe.experts_per_token
    if moe.scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(scores, k)
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias.astype(jnp.float32)
        n, g = choice.shape[0], moe.num_groups
        grouped = choice.reshape(n, g, -1)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, best_groups = jax.lax.top_k(group_score, moe.topk_groups)
        kept = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], best_groups].set(True)
        choice = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(n, -1)
        _, experts = jax.lax.top_k(choice, k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts.astype(jnp.int32)


def experts_mlp(x, w_gate_up, w_down, weights, experts):
    """sum_j weights[n, j] * MLP_{experts[n, j]}(x[n]) with each expert's SwiGLU MLP:
    x [N, H], w_gate_up [E, H, 2I], w_down [E, I, H], weights/experts [N, k] -> [N, H]
    in x.dtype."""
    n, k = experts.shape
    num_experts = w_gate_up.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # the N*k token-expert pairs, by expert
    token = order // k
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    gate_up = jax.lax.ragged_dot(x[token], w_gate_up.astype(x.dtype), sizes,
                                 preferred_element_type=jnp.float32)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    act = (jax.nn.silu(gate) * up).astype(x.dtype)
    out = jax.lax.ragged_dot(act, w_down.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(out).astype(x.dtype)


def moe_mlp(p: dict, cfg: TargetConfig, h, *, impl: str = "auto"):
    """h + MoE(rms_norm(h)): the MLP block of a MoE layer with its residual, h [B, T, H]
    (`p`: the layer's parameters)."""
    moe = cfg.moe
    x = rms_norm(h, p["mlp_norm"], cfg.rms_norm_eps).reshape(-1, h.shape[-1])
    weights, experts = route(moe, x, p["router"], p.get("router_bias"))
    out = experts_mlp(x, p["experts_gate_up"], p["experts_down"], weights, experts)
    if moe.num_shared_experts:
        gate, up = jnp.split(ops.matmul(x, p["shared_gate_up"], impl=impl), 2, axis=-1)
        out = out + ops.matmul(jax.nn.silu(gate) * up, p["shared_down"], impl=impl)
    return h + out.reshape(h.shape)
