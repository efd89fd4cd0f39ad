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

    def head_rows(self, n: int, *, impl: str = "auto") -> "KVCache":
        """Rows [0, n) as a cache of n rows. With the native CPU kernels (`impl`)
        a view: the whole buffers with `lengths[:n]` (those kernels read and
        write only the rows `lengths` counts, in place); otherwise a copy of
        those rows. `put_head_rows` puts it back."""
        if ops.cache_rows_in_place(impl):
            return self.replace(lengths=self.lengths[:n])
        return KVCache(k=self.k[:, :n], v=self.v[:, :n], lengths=self.lengths[:n])

    def put_head_rows(self, part: "KVCache") -> "KVCache":
        """This cache with rows [0, n) taken from `part`, a `head_rows(n)` after its updates."""
        lengths = self.lengths.at[:part.lengths.shape[0]].set(part.lengths)
        if part.k.shape == self.k.shape:  # a native view: its buffers are the whole cache
            return KVCache(k=part.k, v=part.v, lengths=lengths)
        put = lambda big, small: jax.lax.dynamic_update_slice_in_dim(big, small, 0, axis=1)
        return KVCache(k=put(self.k, part.k), v=put(self.v, part.v), lengths=lengths)

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
