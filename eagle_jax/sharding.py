"""Logical axes of the target's and drafter's parameters and caches, and how they map onto a mesh.

A mesh here has two axes, `data` (the batch) and `model` (tensor parallel).
Every parameter dimension has a logical name, carried by the parameter itself
(the models' `nnx.Param` metadata, declared in `target.AXES` and `drafter.AXES`);
`RULES` maps a name onto a mesh axis or None (replicated):
attention heads, the MLP's hidden dimension and the vocabularies go on
`model`, the batch on `data`, as jax-ml/jax-llm-examples' llama3 and
vllm-project/tpu-inference lay out Llama. A dimension is split only where
its mesh axis divides it, in whole heads:

- the fused q|k|v projection (`qkv`) splits piece by piece, so each model
  shard holds whole heads of q, of k and of v (`fused_layout` reorders its
  columns into one group per shard where the axis divides the KV heads and
  the MLP width, and the config's `fused_groups` tells the forward); with fewer KV heads than the
  axis, each shard keeps one KV head (copies of it: as tpu-inference and
  vLLM replicate KV heads), and with a count that neither divides nor is a
  multiple of the axis, the KV part (and the KV cache) stays whole;
- the fused gate|up projection (`ffw2`) splits each half;
- the KV cache (`cache_heads`) splits by KV head as the projection does;
- a MoE layer's routed experts (`experts`) split whole over the model axis, E/m
  experts a device (expert parallelism on the axis attention splits its heads
  over: tpu-inference's 2D layout, jax-llm-examples' experts on a tensor axis;
  `models.moe.routed_experts` runs each device's share), the router replicated
  and the shared experts split as the dense MLP (`ffw`, `ffw2`);
- MLA's per-head up-projections (`mla_q`, `mla_kv`) split by head as o_proj
  (`q_heads`); its down-projection and latent cache, which have no head axis,
  stay whole on the model axis (the cache's rows on data, as the dense cache's).

`per_device_elements` gives what one device holds of an array under these
rules; `eagle-jax plan` (plan.py) adds them up. `shard_model` puts a model's
parameters on a jax Mesh by the axes its module gives them (`Generator(mesh=...)`); the loop then runs
through XLA's partitioner, with the other arrays of its state placed by it,
and the Pallas kernels under `shard_map` on each device's block
(`kernels.fused_norm_matmul`, reading the mesh `Generator.mesh_scope` sets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flax import nnx

from eagle_jax.config import ConfigError

__all__ = ["MeshShape", "RULES", "CACHE_AXES", "parse_mesh", "logical_axes",
           "per_device_elements", "partition_spec", "make_mesh", "fused_layout",
           "shard_params", "shard_model", "shard_cache", "row_shardings", "state_shardings", "fsdp_dim", "to_host"]

RULES: dict[str, str | None] = {
    "batch": "data",
    "vocab": "model", "draft_vocab": "model",
    "qkv": "model", "q_heads": "model", "ffw": "model", "ffw2": "model",
    "cache_heads": "model",
    "layers": None, "embed": None, "embed2": None, "head_dim": None, "aux": None, "aux_states": None,
    "target_embed": None, "seq": None,
    # MoE (models/moe.py): the routed experts split whole over the model axis (expert
    # parallelism), the router replicated; shared experts are a dense MLP (ffw, ffw2).
    "experts": "model", "expert_ffw": None, "expert_ffw2": None, "expert_scores": None,
    # MLA (models/mla.py): the per-head up-projections (q_b: mla_q; kv_b, W_UK | W_UV: mla_kv)
    # by head as q_heads (o_proj); the down-projection and its latents replicated.
    "mla_q": "model", "mla_kv": "model", "mla_a": None, "q_lora": None, "kv_lora": None,
}

CACHE_AXES = ("layers", "batch", "cache_heads", "seq", "head_dim")  # KVCache.k / .v


@dataclass(frozen=True)
class MeshShape:
    data: int
    model: int

    @property
    def devices(self) -> int:
        return self.data * self.model

    def size(self, axis: str | None) -> int:
        return {"data": self.data, "model": self.model, None: 1}[axis]


def parse_mesh(text: str) -> MeshShape:
    """"DATAxMODEL" (e.g. "2x4") -> MeshShape."""
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ConfigError(f"a mesh is DATAxMODEL with positive integers (e.g. 1x8), got {text!r}")
    return MeshShape(int(parts[0]), int(parts[1]))


def _heads_per_shard(heads: int, m: int) -> int:
    """Heads one model shard holds: heads/m where m divides them; one (a copy) where heads
    divide m; all of them otherwise."""
    if heads % m == 0:
        return heads // m
    if m % heads == 0:
        return 1
    return heads


def _dim_per_device(name: str, size: int, mesh: MeshShape, heads: tuple[int, int, int] | None) -> int:
    """How much of a dimension of logical axis `name` one device holds."""
    m = mesh.size(RULES[name])
    if name in ("qkv", "q_heads", "cache_heads"):
        num_heads, num_kv_heads, head_dim = heads
        q = _heads_per_shard(num_heads, m) * head_dim
        kv = _heads_per_shard(num_kv_heads, m) * head_dim
        return {"qkv": q + 2 * kv, "q_heads": q, "cache_heads": kv // head_dim}[name]
    if name == "ffw2":
        half = size // 2
        return 2 * (half // m if half % m == 0 else half)
    return size // m if size % m == 0 else size


def per_device_elements(shape: tuple[int, ...], axes: tuple[str, ...], mesh: MeshShape,
                        heads: tuple[int, int, int] | None = None) -> int:
    """Elements of an array of `shape` with logical `axes` that one device holds.
    heads: (num_heads, num_kv_heads, head_dim) of the model the array belongs to,
    needed for `qkv`, `q_heads` and `cache_heads`."""
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} has {len(shape)} dimensions, axes {axes} name {len(axes)}")
    return math.prod(_dim_per_device(a, n, mesh, heads) for a, n in zip(axes, shape))


def partition_spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: MeshShape):
    """The PartitionSpec of a parameter of `shape` with logical `axes`. A dimension its mesh
    axis does not divide is replicated. Fused q|k|v and gate|up are split into even column
    blocks: with the columns in groups (`fused_layout`, `shard_model`), block i is group i,
    whole heads of q, k and v; in the checkpoint's order XLA would move what each slice
    needs between shards."""
    if len(axes) != len(shape):
        raise ValueError(f"a parameter of shape {shape} does not have the axes {axes}")
    return _spec(axes, shape, mesh)


def _spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: MeshShape):
    """Each dimension on its rule's mesh axis where that axis divides it, else replicated."""
    from jax.sharding import PartitionSpec

    return PartitionSpec(*[RULES[a] if RULES[a] and n % mesh.size(RULES[a]) == 0 else None
                           for a, n in zip(axes, shape)])


def make_mesh(shape: MeshShape):
    """A jax Mesh ("data", "model") over the first DATA*MODEL devices (of every process,
    after `runtime.initialize_distributed`; the mesh must include devices of each)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    if shape.devices > len(devices):
        hint = (f" (on CPU, simulate them: XLA_FLAGS=--xla_force_host_platform_device_count={shape.devices})"
                if devices[0].platform == "cpu" else "")
        raise ConfigError(f"mesh {shape.data}x{shape.model} needs {shape.devices} devices; "
                          f"this {devices[0].platform} backend has {len(devices)}{hint}")
    used = devices[:shape.devices]
    missing = sorted({d.process_index for d in devices} - {d.process_index for d in used})
    if missing:
        raise ConfigError(f"mesh {shape.data}x{shape.model} uses the first {shape.devices} of {len(devices)} devices, "
                          f"none of process {missing[0]}'s: a mesh across processes must span all of them")
    return Mesh(np.array(used).reshape(shape.data, shape.model), ("data", "model"))


def fused_layout(cfg, model: int):
    """(groups, {leaf name: column order}) that lays a model's fused projections out for a
    model axis of `model` shards: `groups` = model where it divides the KV heads and the MLP
    widths (the dense one, and a MoE target's shared experts'; else 1: no reordering), and
    column j of a reordered leaf is column order[j] of the checkpoint's. Group i then holds
    the i-th share of q, of k and of v ([gate | up]: of gate and of up), so each shard
    computes its heads and MLP columns without moving activations between shards; a config
    with `fused_groups=groups` reads that layout."""
    import numpy as np

    moe = getattr(cfg, "moe", None)  # a target's (drafters have none)
    shared = moe.shared_intermediate_size if moe is not None else 0
    if model == 1 or cfg.num_kv_heads % model or cfg.intermediate_size % model or shared % model:
        return 1, {}

    def grouped(*pieces: int):
        """Columns of pieces laid side by side, reordered to the i-th share of each, for each i."""
        blocks = [start + np.arange(size).reshape(model, size // model)
                  for start, size in zip(np.cumsum((0,) + pieces[:-1]), pieces)]
        return np.concatenate(blocks, axis=1).reshape(-1)

    qkv = grouped(cfg.q_size, cfg.kv_size, cfg.kv_size)
    columns = {"wqkv": qkv, "bqkv": qkv, "w_gate_up": grouped(cfg.intermediate_size, cfg.intermediate_size)}
    if shared:
        columns["shared_gate_up"] = grouped(shared, shared)
    return model, columns


def logical_axes(module: nnx.Module) -> dict:
    """The logical axes of each parameter of `module` (Flax's `nnx.get_partition_spec` of its
    state, a tuple of names per leaf), laid out as the parameters it was built from: what
    `shard_params` places them by."""
    import jax
    from jax.sharding import PartitionSpec

    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(module, nnx.Param)))
    return jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_params(params, axes, mesh, columns: dict | None = None):
    """Each leaf put on `mesh` by the PartitionSpec of its logical axes (`axes`: the same
    layout, a tuple of names per leaf): each device receives only its own shard.
    A host (numpy) leaf, such as a memory-mapped checkpoint tensor, is read slice by slice
    (`jax.make_array_from_callback`): no device, and no process, holds a whole copy of it.
    columns: {leaf name: column order} (`fused_layout`) for leaves to reorder on the way."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    shape = MeshShape(mesh.shape["data"], mesh.shape["model"])
    columns = columns or {}

    def put(path, x, leaf_axes):
        name = path[-1].key
        sharding = NamedSharding(mesh, partition_spec(leaf_axes, x.shape, shape))
        order = columns.get(name)
        if isinstance(x, np.ndarray):
            def read(index):
                part = x[index[:-1]]
                cols = index[-1] if order is None else order[index[-1]]
                return np.ascontiguousarray(part[..., cols])
            return jax.make_array_from_callback(x.shape, sharding, read)
        return jax.device_put(x if order is None else x[..., order], sharding)

    return jax.tree_util.tree_map_with_path(put, params, axes)


def shard_model(model_type, cfg, params, mesh):
    """(cfg, params) of a target or drafter (`model_type`: `target.Target` or `drafter.Drafter`)
    put on `mesh` by the logical axes its module gives each parameter, the fused projections
    laid out in groups for its model axis (`fused_layout`; params already in that layout stay so)."""
    import dataclasses

    groups, columns = fused_layout(cfg, mesh.shape["model"])
    if cfg.fused_groups not in (1, groups):
        raise ConfigError(f"parameters laid out for {cfg.fused_groups} model shards cannot be put on "
                          f"a model axis of {mesh.shape['model']}")
    if cfg.fused_groups == groups:
        columns = {}
    axes = logical_axes(model_type(cfg, params))
    return dataclasses.replace(cfg, fused_groups=groups), shard_params(params, axes, mesh, columns)


def shard_cache(cache, mesh):
    """A KVCache put on `mesh`: rows on the data axis and KV heads on the model axis where they divide."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    if cache is None:
        return None
    kv = _spec(CACHE_AXES, cache.k.shape, MeshShape(mesh.shape["data"], mesh.shape["model"]))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    return cache.replace(k=put(cache.k, kv), v=put(cache.v, kv), lengths=put(cache.lengths, PartitionSpec()))


def row_shardings(tree, mesh):
    """NamedShardings for a tree of arrays that lead with rows (the engine's batched state):
    rows on the data axis where it divides them; a `KVCache`'s k / v [L, B, Hkv, S, D] by
    `CACHE_AXES` (rows on data, KV heads on model where they divide)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from eagle_jax.cache import KVCache

    shape = MeshShape(mesh.shape["data"], mesh.shape["model"])
    rows = lambda x: NamedSharding(mesh, PartitionSpec("data") if x.ndim and x.shape[0] % shape.data == 0
                                   else PartitionSpec())

    def leaf(x):
        if isinstance(x, KVCache):
            kv = NamedSharding(mesh, _spec(CACHE_AXES, x.k.shape, shape))
            return x.replace(k=kv, v=kv, lengths=rows(x.lengths))
        return rows(x)

    return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, KVCache))


def state_shardings(tree, mesh, *, fsdp: bool = False):
    """NamedShardings for a training state (a drafter's parameters, its optimizer state, scalars):
    every array whole on each device, or with `fsdp` each split over the data axis along its
    largest dimension that axis divides (XLA's partitioner gathers what a step needs)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    data = mesh.shape["data"]

    def leaf(x):
        dim = fsdp_dim(x.shape, data) if fsdp else None
        if dim is None:
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, PartitionSpec(*["data" if i == dim else None for i in range(x.ndim)]))

    return jax.tree.map(leaf, tree)


def fsdp_dim(shape: tuple[int, ...], data: int) -> int | None:
    """The dimension FSDP splits an array of `shape` along over a data axis of `data` devices:
    its largest one that `data` divides (the first of equals), or None (kept whole: `data` is 1
    or divides none)."""
    dims = [i for i in sorted(range(len(shape)), key=lambda i: -shape[i]) if shape[i] % data == 0]
    return dims[0] if data > 1 and dims else None


def to_host(tree):
    """Each array of `tree` as one numpy array of its whole value. An array that spans
    other processes' devices (a mesh across hosts) is gathered from all of them: every
    process must call this at the same point, as it does the jitted steps."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(fetch, tree)
