"""Target features for drafter training, computed online (and optionally cached on disk).

For a batch of token rows ``tokens [B, T]`` (right-padded; positions ``0..T-1``)
one jitted target pass over an empty cache of length ``T`` gives, at every
position ``p``:

* ``aux [B, T, A*H]``: the residual streams *entering* the target layers
  ``DrafterConfig.aux_layer_ids`` (vLLM/SafeAILab convention), concatenated
  in that order: what the drafter's FC reads (EAGLE.md section 1);
* ``logits [B, T, Vd]`` float32: the target's next-token logits at ``p``
  restricted to the draft vocabulary, ``rms_norm(h_p, final_norm) @
  lm_head[:, target_ids]``; only these ``Vd`` columns of the head are
  multiplied for the loss;
* ``in_vocab [B, T]`` bool: whether the target's argmax over the FULL
  vocabulary at ``p`` lies in the draft vocabulary, i.e. ``max(draft-vocab
  logits) >= max(other logits)``. The other columns are multiplied in vocab
  chunks (``lax.fori_loop``) keeping only a running max, so the full ``[B, T, V]``
  logits never exist in memory. This costs the full lm_head matmul: for
  SmolLM2 (V = 49152, H = 576) about 13% of the target pass's FLOPs
  (measured in the trainer's throughput table). ``argmax_mode="skip"``
  assumes every argmax is in the draft vocabulary (no full matmul).

Because the target is causal, the features of position ``p < length`` do not
depend on the padding or on the batch width, so features can be cached per
example (:class:`FeatureCache`) and re-collated into any later batch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from eagle_jax.config import TargetConfig
from eagle_jax.models import target
from eagle_jax.nn import rms_norm

__all__ = ["Features", "target_features", "draft_vocab_logits", "make_feature_fn", "vocab_shards", "chunk_columns",
           "FeatureCache"]


class Features(NamedTuple):
    aux: jax.Array  # [B, T, A*H] target dtype
    logits: jax.Array  # [B, T, Vd] float32, target logits restricted to the draft vocab
    in_vocab: jax.Array  # [B, T] bool, full-vocab argmax lies in the draft vocab


def chunk_columns(vocab: int, shards: int, chunk: int) -> int:
    """Columns of one shard's part of a chunk in `_nondraft_max`: a vocabulary of `vocab`
    columns split into `shards` contiguous ranges, cut into the fewest chunks of at most
    `chunk` columns, each chunk taking an equal part of every range (rounded up)."""
    return -(-(vocab // shards) // -(-vocab // chunk))


def _nondraft_max(normed, w, t2d, chunk: int, shards: int = 1, vocab_axis: int = 1):
    """max over target ids NOT in the draft vocab of the logits normed @ head, chunked over the vocab.

    normed [B, T, H]; w: the head as stored (`_stored_head`), an lm_head [H, V] (vocab_axis 1) or
    a tied embedding [V, H] (vocab_axis 0); t2d [V] bool. Returns float32 [B, T] (-inf if none).
    shards: how many contiguous ranges of the vocabulary a mesh's model axis splits w into
    (`vocab_shards`; 1 on one device). Each chunk takes `chunk_columns` adjacent ids from every
    range, sliced from w as stored inside the loop, so that each device multiplies its own part
    of w and only a chunk of it is ever copied (a head transposed into chunks before the loop was
    copied whole, twice, and gathered in part where a chunk cut across the ranges). XLA:CPU
    still holds one float32 copy of a bfloat16 w: it slices bfloat16 by converting the operand,
    and moves that out of the loop (GPUs and TPUs slice it as it is). The last chunk starts
    early enough to end with its range, overlapping the one before (a max does not mind).
    """
    v, h = w.shape[vocab_axis], normed.shape[-1]
    per = v // shards  # ids of one range
    c = chunk_columns(v, shards, chunk)
    if vocab_axis == 1:  # [S, H, per]: on each device a bitcast of its [H, per]
        w3, product = w.reshape(h, shards, per).transpose(1, 0, 2), "bth,shc->btsc"
    else:  # [S, per, H]
        w3, product = w.reshape(shards, per, h), "bth,sch->btsc"
    excl = t2d.reshape(shards, per)

    def one(i, best):  # best [B, T, S]: the running max of each range
        start = jnp.minimum(i * c, per - c)
        wc = jax.lax.dynamic_slice_in_dim(w3, start, c, axis=1 + vocab_axis)
        lg = jnp.einsum(product, normed, wc.astype(normed.dtype), preferred_element_type=jnp.float32)
        ex = jax.lax.dynamic_slice_in_dim(excl, start, c, axis=1)  # [S, C]
        return jnp.maximum(best, jnp.max(jnp.where(ex, -jnp.inf, lg), axis=-1))

    best = jnp.full((*normed.shape[:-1], shards), -jnp.inf, jnp.float32)
    return jnp.max(jax.lax.fori_loop(0, -(-per // c), one, best), axis=-1)


def _stored_head(tparams) -> tuple[jax.Array, int]:
    """The target's output head as stored and the axis of its vocabulary: the lm_head [H, V]
    and 1, or the tied embedding [V, H] and 0."""
    return (tparams["lm_head"], 1) if "lm_head" in tparams else (tparams["embed"], 0)


def vocab_shards(tparams) -> int:
    """How many contiguous column ranges the placement of the target's lm_head (or tied
    embedding) splits its vocabulary into: the size of the mesh axis it is split over, 1
    when it is whole on each device."""
    w, axis = _stored_head(tparams)
    sharding = getattr(w, "sharding", None)  # none: a host array, or a shape placed nowhere
    return 1 if sharding is None else w.shape[axis] // sharding.shard_shape(w.shape)[axis]


def draft_head(tparams, tcfg: TargetConfig, target_ids) -> jax.Array:
    """The target's lm_head columns of the draft vocabulary, [H, Vd] (target_ids [Vd] int32:
    draft id -> target id). Taken once per run: on a mesh whose model axis splits the
    vocabulary, taking them is a gather of the whole head."""
    return jnp.take(target.Target(tcfg, tparams).lm_head_weight(), target_ids, axis=1)


def target_features(tparams, tcfg: TargetConfig, tokens, *, aux_layers: tuple[int, ...],
                    head, t2d, argmax_mode: str = "chunked", vocab_chunk: int = 8192,
                    vocab_shards: int = 1, impl: str = "auto", forward_params=None):
    """Target pass over tokens [B, T] -> (aux, normed final hidden [B, T, H], in_vocab [B, T]).

    head [H, Vd]: `draft_head`; t2d [V] bool.
    forward_params: the same target prepared for the native kernels
    (`target.prepare_for_decoding`), for the decoder layers; the head's
    columns are picked from `tparams`.
    argmax_mode: "chunked" (exact, chunks of about `vocab_chunk` columns of the
    vocabulary, each device taking its part of each chunk from its `vocab_shards`
    range: `_nondraft_max`), "full" (exact, one [B,T,V] matmul) or "skip" (in_vocab
    all True).
    """
    b, t = tokens.shape
    dtype = tparams["embed"].dtype
    cache = target.create_cache(tcfg, b, t, dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    model = target.Target(tcfg, tparams)
    hidden, _, aux = (model if forward_params is None else target.Target(tcfg, forward_params))(
        tokens, positions, cache, aux_layers=aux_layers, impl=impl)
    normed = rms_norm(hidden, tparams["final_norm"], tcfg.rms_norm_eps)
    w = model.lm_head_weight()
    if argmax_mode == "skip":
        in_vocab = jnp.ones((b, t), bool)
    else:
        dmax = jnp.max(draft_vocab_logits(normed, head), -1)
        if argmax_mode == "full":
            full = jnp.dot(normed, w.astype(normed.dtype), preferred_element_type=jnp.float32)
            other = jnp.max(jnp.where(t2d, -jnp.inf, full), axis=-1)
        elif argmax_mode == "chunked":
            stored, vocab_axis = _stored_head(tparams)
            other = _nondraft_max(normed, stored, t2d, vocab_chunk, vocab_shards, vocab_axis)
        else:
            raise ValueError(f"argmax_mode must be chunked, full or skip, got {argmax_mode!r}")
        in_vocab = dmax >= other
    return aux, normed, in_vocab


def draft_vocab_logits(normed, head):
    """normed final hidden [..., H] -> float32 target logits over the draft vocab [..., Vd]
    (head [H, Vd]: `draft_head`)."""
    return jnp.dot(normed, head.astype(normed.dtype), preferred_element_type=jnp.float32)


def make_feature_fn(tcfg: TargetConfig, aux_layers: Sequence[int], *, argmax_mode: str = "chunked",
                    vocab_chunk: int = 8192, vocab_shards: int = 1, impl: str = "auto",
                    return_normed: bool = False):
    """A jitted ``fn(tparams, tokens, head, t2d, forward_params=None) -> Features`` (head: `draft_head`)
    (or ``(Features, normed)`` with ``return_normed``, for the disk cache). vocab_shards: `vocab_shards`
    of the tparams it will take (on a mesh whose model axis splits the vocabulary, its size)."""
    aux_layers = tuple(int(i) for i in aux_layers)
    if vocab_shards < 1 or tcfg.vocab_size % vocab_shards:
        raise ValueError(f"vocab_shards must divide the vocabulary ({tcfg.vocab_size}), got {vocab_shards}")

    @jax.jit
    def fn(tparams, tokens, head, t2d, forward_params=None):
        aux, normed, in_vocab = target_features(
            tparams, tcfg, tokens, aux_layers=aux_layers, head=head, t2d=t2d,
            argmax_mode=argmax_mode, vocab_chunk=vocab_chunk, vocab_shards=vocab_shards, impl=impl,
            forward_params=forward_params)
        feats = Features(aux, draft_vocab_logits(normed, head), in_vocab)
        return (feats, normed) if return_normed else feats

    return fn


# ----------------------------------------------------------------------------- disk cache

_BF16 = np.dtype(ml_dtypes.bfloat16)


class FeatureCache:
    """Per-example target features on disk, in shards, for repeated epochs.

    Stored per token: ``aux`` (A*H) and the normalised final hidden state (H)
    in bfloat16 (as uint16 bits) plus the ``in_vocab`` flag (1 byte): for
    SmolLM2 (A = 3, H = 576) 4609 bytes per token, i.e. about 4.6 GB per
    million tokens. The draft-vocab logits are recomputed from the hidden
    state (one [H, Vd] matmul) rather than stored (Vd values per token).

    Layout: ``dir/shard_00000.npy`` ([N_tokens, A*H + H] uint16),
    ``dir/shard_00000.flags.npy`` ([N_tokens] uint8) and ``dir/index.json``
    (``{"meta": ..., "examples": {example_index: [shard, offset, length]}}``).
    Shards and the index are written to temporary files and renamed, so a
    crash loses at most the shard being filled. ``meta`` (target, aux layers,
    dtype, ...) must match for the cache to be reused; otherwise it is wiped.
    """

    def __init__(self, directory: str | os.PathLike, meta: dict, shard_tokens: int = 1 << 18):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.meta = json.loads(json.dumps(meta, sort_keys=True))
        self.shard_tokens = shard_tokens
        self.index: dict[int, tuple[int, int, int]] = {}
        self.num_shards = 0
        idx = self.dir / "index.json"
        if idx.is_file():
            d = json.loads(idx.read_text())
            if d.get("meta") == self.meta:
                self.index = {int(k): tuple(v) for k, v in d["examples"].items()}
                self.num_shards = int(d.get("num_shards", 0))
            else:
                for f in self.dir.glob("shard_*"):
                    f.unlink()
        self._buf: list[np.ndarray] = []
        self._flags: list[np.ndarray] = []
        self._pending: dict[int, tuple[int, int]] = {}
        self._fill = 0
        self._mm: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __contains__(self, example_index: int) -> bool:
        return int(example_index) in self.index

    def has_all(self, indices) -> bool:
        return all(int(i) in self.index for i in indices)

    def add(self, example_index: int, aux: np.ndarray, normed: np.ndarray, in_vocab: np.ndarray):
        """aux [n, A*H], normed [n, H], in_vocab [n] of one example (its real tokens only)."""
        k = int(example_index)
        if k in self.index or k in self._pending:
            return
        row = np.concatenate([np.asarray(aux, np.float32), np.asarray(normed, np.float32)], -1)
        self._buf.append(row.astype(_BF16).view(np.uint16))
        self._flags.append(np.asarray(in_vocab, np.uint8))
        self._pending[k] = (self._fill, row.shape[0])
        self._fill += row.shape[0]
        if self._fill >= self.shard_tokens:
            self.flush()

    def flush(self):
        if not self._buf:
            return
        s = self.num_shards
        for name, arr in ((f"shard_{s:05d}.npy", np.concatenate(self._buf)),
                          (f"shard_{s:05d}.flags.npy", np.concatenate(self._flags))):
            tmp = self.dir / (name + ".tmp.npy")
            np.save(tmp, arr)
            os.replace(tmp, self.dir / name)
        for k, (off, n) in self._pending.items():
            self.index[k] = (s, off, n)
        self.num_shards += 1
        self._buf, self._flags, self._pending, self._fill = [], [], {}, 0
        tmp = self.dir / "index.json.tmp"
        tmp.write_text(json.dumps({"meta": self.meta, "num_shards": self.num_shards,
                                   "examples": {str(k): list(v) for k, v in self.index.items()}}))
        os.replace(tmp, self.dir / "index.json")

    def _shard(self, s: int):
        if s not in self._mm:
            self._mm[s] = (np.load(self.dir / f"shard_{s:05d}.npy", mmap_mode="r"),
                           np.load(self.dir / f"shard_{s:05d}.flags.npy", mmap_mode="r"))
        return self._mm[s]

    def get(self, example_index: int):
        """-> (feats float32 [n, A*H + H], in_vocab bool [n])."""
        s, off, n = self.index[int(example_index)]
        data, flags = self._shard(s)
        return (np.asarray(data[off:off + n]).view(_BF16).astype(np.float32),
                np.asarray(flags[off:off + n]).astype(bool))

    def collate(self, indices, width: int, aux_size: int):
        """Batch [B, width] of cached examples (rows -1 = empty): (aux, normed, in_vocab)."""
        b = len(indices)
        feats = np.zeros((b, width, self._row_size(aux_size)), np.float32)
        flags = np.zeros((b, width), bool)
        for r, k in enumerate(indices):
            if k < 0:
                continue
            f, fl = self.get(k)
            n = min(len(f), width)
            feats[r, :n] = f[:n]
            flags[r, :n] = fl[:n]
        return feats[..., :aux_size], feats[..., aux_size:], flags

    def _row_size(self, aux_size: int) -> int:
        for s in range(self.num_shards):
            return int(self._shard(s)[0].shape[1])
        raise ValueError("empty feature cache")

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.dir.glob("shard_*.npy"))
