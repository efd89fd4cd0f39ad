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

On a mesh (expert parallelism, `sharding.RULES`): the routed experts are split over
the model axis, E/m whole experts a device, as attention splits its heads there. The
router and its choice run on every device of a row's data shard (both are small);
`routed_experts` then runs each device's own experts on the pairs routed to them
(`shard_map`) and sums the partial outputs over the model axis: one all-reduce of
[tokens, H], as a row-parallel dense MLP ends with. Left to XLA's partitioner, the
grouped matmul over split experts gathers every data shard's pairs and all-reduces
[N k, H] instead. Shared experts follow the dense MLP's rules (`ffw`, `ffw2`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax.config import MoEConfig, TargetConfig
from eagle_jax.kernels import ops
from eagle_jax.nn import rms_norm
from eagle_jax.sharding import RULES

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
        kept = (jnp.arange(g)[None, :, None] == best_groups[:, None, :]).any(-1)  # [N, G]: no scatter to partition
        choice = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(n, -1)
        _, experts = jax.lax.top_k(choice, k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts.astype(jnp.int32)


def experts_mlp(x, w_gate_up, w_down, weights, experts, first=0):
    """sum_j weights[n, j] * MLP_{experts[n, j]}(x[n]) with each expert's SwiGLU MLP, of
    the experts `first` .. `first` + E - 1 that w_gate_up / w_down hold (a device's share
    on a mesh; pairs routed elsewhere add nothing and take no grouped-matmul rows):
    x [N, H], w_gate_up [E, H, 2I], w_down [E, I, H], weights/experts [N, k] -> [N, H]
    float32 (the sum unrounded)."""
    n, k = experts.shape
    num_experts = w_gate_up.shape[0]
    local = experts.reshape(-1) - first
    mine = (local >= 0) & (local < num_experts)
    local = jnp.where(mine, local, num_experts)  # others sort last, past every group
    order = jnp.argsort(local, stable=True)  # the N*k token-expert pairs, by expert
    token = order // k
    sizes = jnp.bincount(local, length=num_experts).astype(jnp.int32)  # drops the others
    gate_up = jax.lax.ragged_dot(x[token], w_gate_up.astype(x.dtype), sizes,
                                 preferred_element_type=jnp.float32)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    act = (jax.nn.silu(gate) * up).astype(x.dtype)
    out = jax.lax.ragged_dot(act, w_down.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    out = out * jnp.where(mine, weights.reshape(-1), 0.0)[order][:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(out)


def routed_experts(x, w_gate_up, w_down, weights, experts, *, batch: int):
    """`experts_mlp` of all the experts, in x.dtype; under a context mesh (`jax.set_mesh`)
    whose model axis m divides the E experts (`sharding.RULES` puts them there), each
    device runs its E/m experts on its data shard's pairs (`shard_map`) and the partial
    sums are added over the model axis. x [N, H] holds `batch` rows' tokens, row-major
    (its rows split on the data axis where that divides `batch`)."""
    mesh = jax.sharding.get_abstract_mesh()
    axis = RULES["experts"]
    num_experts = w_gate_up.shape[0]
    if mesh.empty or axis not in mesh.axis_names or mesh.shape[axis] == 1 or num_experts % mesh.shape[axis]:
        return experts_mlp(x, w_gate_up, w_down, weights, experts).astype(x.dtype)
    from jax.sharding import PartitionSpec as P

    share = num_experts // mesh.shape[axis]
    rows = "data" if "data" in mesh.axis_names and batch % mesh.shape["data"] == 0 else None

    def local(x, w_gate_up, w_down, weights, experts):
        part = experts_mlp(x, w_gate_up, w_down, weights, experts, first=jax.lax.axis_index(axis) * share)
        return jax.lax.psum(part, axis)

    out = jax.shard_map(local, in_specs=(P(rows), P(axis), P(axis), P(rows), P(rows)), out_specs=P(rows),
                        check_vma=False)(x, w_gate_up, w_down, weights, experts)
    return out.astype(x.dtype)


def moe_mlp(p: dict, cfg: TargetConfig, h, *, impl: str = "auto"):
    """h + MoE(rms_norm(h)): the MLP block of a MoE layer with its residual, h [B, T, H]
    (`p`: the layer's parameters)."""
    moe = cfg.moe
    x = rms_norm(h, p["mlp_norm"], cfg.rms_norm_eps).reshape(-1, h.shape[-1])
    weights, experts = route(moe, x, p["router"], p.get("router_bias"))
    out = routed_experts(x, p["experts_gate_up"], p["experts_down"], weights, experts,
                         batch=h.shape[0]).reshape(h.shape)
    if moe.num_shared_experts:  # a dense SwiGLU MLP ([gate | up] in `fused_groups` groups)
        act = ops.norm_swiglu(h, p["mlp_norm"], p["shared_gate_up"], eps=cfg.rms_norm_eps,
                              groups=cfg.fused_groups, impl=impl)
        out = out + ops.matmul(act, p["shared_down"], impl=impl)
    return h + out
