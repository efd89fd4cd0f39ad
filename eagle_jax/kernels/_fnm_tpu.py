"""TPU (Mosaic) lowering of fused_norm_matmul.

Grid (M/bm, N/bn, S * ks/bk), the K steps innermost and "arbitrary". The
weight is the caller's [K, N] array, read in (bk, bn) blocks and never
copied: bk divides the segment length ks (a multiple of 128, or the whole
segment when ks is not a multiple of 128), so a K step never straddles two
segments; bn is N itself up to 512 columns (1024 when N >= 8192), else that
cap, with the last N block partial (Pallas pads its reads and drops its
out-of-bounds writes: the garbage columns of W only reach output columns
that are never written). The activations are small and re-laid out per
call: x [M, K] -> [S, M_pad, ks] (rows zero-padded to bm), the gains
-> [S, 1, ks] in f32, so their blocks (bm, bk) and (1, bk) obey the (8, 128)
rule whatever ks is. The W block (bk, bn) needs bk % 8 == 0 unless it spans
the whole K (one segment), hence segment lengths that are multiples of 8.

VMEM scratch, all f32: ``acc`` (bm, bn), the output accumulator; ``seg``
(bm, bn), the current segment's partial product of (x * g) @ W (only when
segments > 1); ``ss`` (bm, bn), the running sum of squares of the current
segment's x row, kept broadcast over the lanes so it multiplies ``seg``
without any lane slicing. At a segment's last K step: acc += seg *
rsqrt(ss/ks + eps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from eagle_jax.kernels._refs import split_refs

_W_TILE_BYTES = 4 * 1024 * 1024  # target bytes of one W block (double-buffered)
_MAX_BM = 256


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def block_sizes(m: int, k: int, n: int, segments: int, x_itemsize: int, w_itemsize: int):
    """(bm, bk, bn) for x [m, k] and w [k, n] split into `segments`; ValueError when
    a segment length cannot be blocked without copying W."""
    ks = k // segments
    if segments > 1 and ks % 8:
        raise ValueError(f"the TPU kernel needs a segment length divisible by 8 with segments > 1, "
                         f"got K={k} in {segments} segments")
    sub = 8 if x_itemsize >= 4 else 16
    bm = _round_up(m, sub) if m <= _MAX_BM else _MAX_BM
    cap = 1024 if n >= 8192 else 512
    bn = n if n <= cap else cap
    if ks % 128 == 0:
        fits = [d for d in range(128, ks + 1, 128)
                if ks % d == 0 and d * bn * w_itemsize <= _W_TILE_BYTES]
        return bm, (max(fits) if fits else 128), bn
    while ks * bn * w_itemsize > _W_TILE_BYTES and bn > 128:
        bn = max(128, bn // 2 // 128 * 128)
    return bm, ks, bn


def _kernel(layer_ref, *refs, tiles_per_seg, n_k, inv_ks, eps, precision, has_bias, has_init, multi_seg):
    del layer_ref  # read by the weight's index map only
    x_ref, g_ref, w_ref, b_ref, rest = split_refs(refs, has_bias, has_init)
    o_ref, acc_ref = rest[0], rest[1]
    seg_ref = rest[2] if multi_seg else acc_ref
    ss_ref = rest[-1]

    kk = pl.program_id(2)
    t = jax.lax.rem(kk, tiles_per_seg) if multi_seg else kk

    @pl.when(kk == 0)
    def _init_acc():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(t == 0)
    def _init_segment():
        if multi_seg:
            seg_ref[...] = jnp.zeros(seg_ref.shape, jnp.float32)
        ss_ref[...] = jnp.zeros(ss_ref.shape, jnp.float32)

    x = x_ref[...]
    xf = x.astype(jnp.float32)
    xg = (xf * g_ref[...]).astype(x.dtype)
    w = w_ref[...]
    if w.dtype != x.dtype:
        w = w.astype(x.dtype)
    seg_ref[...] += jnp.dot(xg, w, preferred_element_type=jnp.float32, precision=precision)
    ss_ref[...] += jnp.sum(xf * xf, axis=1, keepdims=True)

    def scaled_segment():
        return seg_ref[...] * jax.lax.rsqrt(ss_ref[...] * inv_ks + eps)

    if multi_seg:
        @pl.when(t == tiles_per_seg - 1)
        def _close_segment():
            acc_ref[...] += scaled_segment()

    @pl.when(kk == n_k - 1)
    def _write():
        out = acc_ref[...] if multi_seg else scaled_segment()
        if has_bias:
            out = out + b_ref[...].astype(jnp.float32)
        o_ref[...] = out.astype(o_ref.dtype)


def _segment_major(x2, s, ks, m_pad):
    """x2 [M, S*ks] -> [S, m_pad, ks], rows zero-padded (activation-sized)."""
    m = x2.shape[0]
    x3 = jnp.transpose(x2.reshape(m, s, ks), (1, 0, 2))
    return jnp.pad(x3, ((0, 0), (0, m_pad - m), (0, 0))) if m_pad != m else x3


def run(x2, g, w, bias, *, segments, eps, interpret=False, poison=None, layer=None, out_dtype=None):
    """x2 [M, K], g [K] or [S, K/S], w [K, N] (or [L, K, N] with layer an int32
    scalar), bias [N] or None -> [M, N] in out_dtype (default x2.dtype: the f32
    accumulator is rounded once, in the kernel). `interpret`: False
    (compiled), True (under `pltpu.InterpretParams`) or "hlo" (Pallas's
    generic interpreter)."""
    m, k = x2.shape
    s, n = segments, w.shape[-1]
    ks = k // s
    out_dtype = jnp.dtype(x2.dtype if out_dtype is None else out_dtype)
    x_item, w_item, o_item = jnp.dtype(x2.dtype).itemsize, jnp.dtype(w.dtype).itemsize, out_dtype.itemsize
    bm, bk, bn = block_sizes(m, k, n, s, x_item, w_item)
    m_pad = _round_up(m, bm)
    tiles_per_seg = ks // bk
    n_k = s * tiles_per_seg
    grid = (m_pad // bm, pl.cdiv(n, bn), n_k)
    multi_seg = s > 1
    precision = jax.lax.Precision.HIGHEST if x2.dtype == jnp.float32 else None

    seg_of = lambda kk: (jax.lax.div(kk, tiles_per_seg), jax.lax.rem(kk, tiles_per_seg))  # no sign ops
    args = [_segment_major(x2, s, ks, m_pad), g.astype(jnp.float32).reshape(s, 1, ks), w]
    # Index maps take the grid indices and the scalar-prefetch ref (the layer).
    w_spec = (pl.BlockSpec((bk, bn), lambda i, j, kk, lr: (kk, j)) if layer is None
              else pl.BlockSpec((None, bk, bn), lambda i, j, kk, lr: (lr[0], kk, j)))
    in_specs = [pl.BlockSpec((None, bm, bk), lambda i, j, kk, lr: (seg_of(kk)[0], i, seg_of(kk)[1])),
                pl.BlockSpec((None, 1, bk), lambda i, j, kk, lr: (seg_of(kk)[0], 0, seg_of(kk)[1])),
                w_spec]
    out_spec = pl.BlockSpec((bm, bn), lambda i, j, kk, lr: (i, j))
    if bias is not None:
        args.append(bias.reshape(1, n))
        in_specs.append(pl.BlockSpec((1, bn), lambda i, j, kk, lr: (0, j)))
    aliases = {}
    if poison is not None:
        aliases = {1 + len(args): 0}  # operand 0 is the layer
        args.append(jnp.full((m_pad, n), poison, out_dtype))
        in_specs.append(out_spec)

    scratch = [pltpu.VMEM((bm, bn), jnp.float32) for _ in range(3 if multi_seg else 2)]
    vmem_need = (2 * (bm * bk * x_item + 8 * bk * 4 + bk * bn * w_item + 8 * bn * 4)
                 + 2 * bm * bn * o_item + len(scratch) * bm * bn * 4)
    vmem_limit = int(min(max(2 * vmem_need, 32 * 2**20), 48 * 2**20))

    kernel = functools.partial(
        _kernel, tiles_per_seg=tiles_per_seg, n_k=n_k, inv_ks=1.0 / ks, eps=eps,
        precision=precision, has_bias=bias is not None, has_init=poison is not None,
        multi_seg=multi_seg)
    cost = pl.CostEstimate(
        flops=2 * m_pad * k * n, transcendentals=m_pad * n * s,
        bytes_accessed=m_pad * k * x_item + k * n * w_item + m_pad * n * o_item)
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, in_specs=in_specs,
                                             out_specs=out_spec, scratch_shapes=scratch)
    layer = jnp.zeros((1,), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n), out_dtype),
        grid_spec=grid_spec,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit),
        cost_estimate=cost,
        interpret=True if interpret == "hlo" else pltpu.InterpretParams() if interpret else False,
        name="fused_norm_matmul_tpu",
    )(layer, *args)
    return out[:m] if m_pad != m else out
