"""KV cache with a static maximum length and per-row lengths.

Slots `[0, lengths[b])` of row b hold committed tokens. A model forward over
T new tokens `write`s their K/V at slots `lengths[b] + t` (writes past the end
are dropped) without advancing `lengths`, and attends over the written cache
(the XLA path through `written_mask`; the native kernel writes and attends in
one call); the caller commits what it accepted
(`commit`) or first moves an accepted tree path into contiguous slots
(`compact`). Rows of a batch therefore advance independently.

Layout: [L, B, Hkv, S, D] (heads before slots, so q.K is a contiguous
batched matmul).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from eagle_jax.kernels import ops


@flax.struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, Hkv, S, D]
    v: jax.Array  # [L, B, Hkv, S, D]
    lengths: jax.Array  # [B] int32, committed tokens per row

    @classmethod
    def create(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
               head_dim: int, dtype=jnp.float32) -> "KVCache":
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def write(self, k_new: jax.Array, v_new: jax.Array, *, layer=0, impl: str = "auto") -> "KVCache":
        """Store k_new/v_new [L', B, T, Hkv, D] at slots lengths[b] + t of layers
        layer .. layer + L' - 1 (`layer`: int or int32 scalar, traced or not).

        With the native CPU kernels (`impl`) the slots are copied in place;
        otherwise an XLA scatter of the values' bits. Both are differentiated as
        the float scatter."""
        k, v = ops.cache_write(self.k, self.v, self.lengths, layer, k_new, v_new, impl=impl)
        return self.replace(k=k, v=v)

    def head_rows(self, n: int, *, impl: str = "auto", groups: int = 1) -> "KVCache":
        """The first n // groups rows of each of `groups` equal blocks of rows, as a cache
        of n rows (`head_of`: on a mesh, each data shard keeps its own rows). With the
        native CPU kernels (`impl`, one group) a view: the whole buffers with
        `lengths[:n]` (those kernels read and write only the rows `lengths` counts, in
        place); otherwise a copy of those rows. `put_head_rows` puts it back."""
        if ops.cache_rows_in_place(impl) and groups == 1:
            return self.replace(lengths=self.lengths[:n])
        return KVCache(k=head_of(self.k, n, groups, axis=1), v=head_of(self.v, n, groups, axis=1),
                       lengths=head_of(self.lengths, n, groups))

    def put_head_rows(self, part: "KVCache", groups: int = 1) -> "KVCache":
        """This cache with the rows of a `head_rows(n, groups=groups)` taken from `part`."""
        lengths = put_head_of(self.lengths, part.lengths, groups)
        if part.k.shape == self.k.shape:  # a native view: its buffers are the whole cache
            return KVCache(k=part.k, v=part.v, lengths=lengths)
        return KVCache(k=put_head_of(self.k, part.k, groups, axis=1), v=put_head_of(self.v, part.v, groups, axis=1),
                       lengths=lengths)

    def commit(self, n: jax.Array) -> "KVCache":
        """Advance each row's length by n [B] (the first n written slots become context)."""
        return self.replace(lengths=jnp.minimum(self.lengths + n.astype(jnp.int32), self.max_len))

    def compact(self, src: jax.Array, n: jax.Array, *, impl: str = "auto") -> "KVCache":
        """Accept a tree path: for each row b and j < n[b], copy the slot
        `lengths[b] + src[b, j]` to `lengths[b] + j`, then commit n.

        src [B, A] int32 holds offsets relative to the row's length (the
        accepted nodes' positions among the T tokens of the last forward).
        """
        k, v = ops.cache_compact(self.k, self.v, self.lengths, src, n, impl=impl)
        return self.replace(k=k, v=v).commit(n)


def written_mask(lengths: jax.Array, max_len: int, new_mask: jax.Array) -> jax.Array:
    """[B, t, max_len]: new_mask [B, t, t] over the slots `write` puts the t new
    tokens in: query i sees slot lengths + j where new_mask[i, j] (a slot past
    the end holds nothing: its write was dropped)."""
    t = new_mask.shape[-1]
    j = jnp.arange(max_len, dtype=jnp.int32)[None] - lengths[:, None]  # [B, S]: which new token, if any
    idx = jnp.broadcast_to(jnp.clip(j, 0, t - 1)[:, None, :], new_mask.shape[:2] + (max_len,))
    return jnp.take_along_axis(new_mask, idx, axis=2) & ((j >= 0) & (j < t))[:, None, :]


def committed_mask(lengths: jax.Array, max_len: int, t: int) -> jax.Array:
    """[B, t, max_len]: every query of a forward sees exactly the committed slots."""
    visible = jnp.arange(max_len, dtype=jnp.int32)[None] < lengths[:, None]
    return jnp.broadcast_to(visible[:, None, :], (lengths.shape[0], t, max_len))


def causal_mask(batch: int, t: int) -> jax.Array:
    """[B, t, t] lower-triangular mask among new tokens."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


def head_of(x: jax.Array, n: int, groups: int = 1, axis: int = 0) -> jax.Array:
    """The first n // groups rows of each of `groups` equal blocks of x's `axis`, side by side:
    [..., B, ...] -> [..., n, ...]. Where a mesh's data axis splits that axis into `groups`
    shards, each keeps its own rows (the reshapes and the slice move nothing between devices)."""
    if groups == 1:
        return jax.lax.slice_in_dim(x, 0, n, axis=axis)
    blocks = x.reshape(x.shape[:axis] + (groups, x.shape[axis] // groups) + x.shape[axis + 1:])
    part = jax.lax.slice_in_dim(blocks, 0, n // groups, axis=axis + 1)
    return part.reshape(x.shape[:axis] + (n,) + x.shape[axis + 1:])


def put_head_of(big: jax.Array, part: jax.Array, groups: int = 1, axis: int = 0) -> jax.Array:
    """`big` with the rows `head_of(big, n, groups, axis)` takes replaced by `part` [..., n, ...]."""
    if groups == 1:
        return jax.lax.dynamic_update_slice_in_dim(big, part.astype(big.dtype), 0, axis)
    split = lambda x: x.reshape(x.shape[:axis] + (groups, x.shape[axis] // groups) + x.shape[axis + 1:])
    out = jax.lax.dynamic_update_slice_in_dim(split(big), split(part).astype(big.dtype), 0, axis + 1)
    return out.reshape(big.shape)
