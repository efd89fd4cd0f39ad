"""KV cache with a static maximum length and per-row lengths.

Slots `[0, lengths[b])` of row b hold committed tokens. A model forward over
T new tokens writes their K/V at slots `lengths[b] + t` (writes past the end
are dropped) but does not advance `lengths`; the caller commits what it
accepted (`commit`) or first moves an accepted tree path into contiguous
slots (`compact`). Rows of a batch therefore advance independently.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, Hkv, D]
    v: jax.Array  # [L, B, S, Hkv, D]
    lengths: jax.Array  # [B] int32, committed tokens per row

    @classmethod
    def create(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
               head_dim: int, dtype=jnp.float32) -> "KVCache":
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def commit(self, n: jax.Array) -> "KVCache":
        """Advance each row's length by n [B] (the first n written slots become context)."""
        return self.replace(lengths=jnp.minimum(self.lengths + n.astype(jnp.int32), self.max_len))

    def compact(self, src: jax.Array, n: jax.Array) -> "KVCache":
        """Accept a tree path: for each row b and j < n[b], copy the slot
        `lengths[b] + src[b, j]` to `lengths[b] + j`, then commit n.

        src [B, A] int32 holds offsets relative to the row's length (the
        accepted nodes' positions among the T tokens of the last forward).
        """
        a = src.shape[1]
        base = self.lengths[:, None]
        src_slot = base + src
        dst_slot = jnp.where(jnp.arange(a)[None] < n[:, None], base + jnp.arange(a)[None], self.max_len)
        rows = jnp.arange(self.batch)[:, None]

        def move(buf):  # buf [L, B, S, Hkv, D]
            picked = buf[:, rows, jnp.clip(src_slot, 0, self.max_len - 1)]  # [L, B, A, Hkv, D]
            return buf.at[:, rows, dst_slot].set(picked, mode="drop")

        return self.replace(k=move(self.k), v=move(self.v)).commit(n)


def write_slots(lengths: jax.Array, t: int) -> jax.Array:
    """Slots the next forward over t tokens writes: [B, t] int32."""
    return lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]


def attention_mask(lengths: jax.Array, max_len: int, new_mask: jax.Array | None, t: int) -> jax.Array:
    """Absolute key mask [B, t, max_len] for t new tokens.

    Every committed slot (< lengths[b]) is visible; among the new tokens
    (slots lengths[b] .. lengths[b]+t-1) visibility follows `new_mask`
    [B, t, t] (True = query i may see new token j), causal when None.
    """
    b = lengths.shape[0]
    if new_mask is None:
        new_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    rel = jnp.arange(max_len, dtype=jnp.int32)[None] - lengths[:, None]  # [B, S]
    in_new = (rel >= 0) & (rel < t)
    idx = jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (b, t, max_len))
    new_visible = jnp.take_along_axis(new_mask, idx, axis=2)
    return (rel < 0)[:, None, :] | (in_new[:, None, :] & new_visible)
