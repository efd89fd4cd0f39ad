"""TPU (Mosaic) lowering of fused_norm_matmul.

Grid (M/bm, N/bn, K/bk), K innermost and "arbitrary"; blocks x (bm, bk),
W' (bk, bn), out (bm, bn). Every block obeys the (8, 128) rule and tiles its
array exactly: x's rows are zero-padded per call to a multiple of bm (x is
small), W' comes pre-padded in the "tpu" FoldedWeight layout (each segment's
rows to a multiple of 128 unless a single full-K block is used; columns to a
multiple of bn), so no block is partial and nothing relies on out-of-bounds
reads. Zero rows/columns add nothing to the products or the sums of squares;
the mean divides by the true segment length.

VMEM scratch, all f32: ``acc`` (bm, bn), the output accumulator; ``seg``
(bm, bn), the current segment's partial product (only when segments > 1);
``ss`` (bm, bn), the running sum of squares of the current segment's x row,
kept broadcast over the lanes so it multiplies ``seg`` without any lane
slicing. Since bk divides the padded segment length, each K step lies in one
segment; at its last step the segment is folded: acc += seg * rsqrt(ss/ks +
eps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from eagle_jax.kernels._refs import split_refs

_W_TILE_BYTES = 4 * 1024 * 1024  # target bytes of one W' block (double-buffered)
_MAX_BM = 256
# With one segment whose K is not a multiple of 128 (SmolLM2: K=576), use a
# single full-K block (legal under the block rule, no padding, but a matmul
# with an unaligned contraction dim for Mosaic). Set False to zero-pad K to a
# multiple of 128 instead (+11% W bytes at K=576). Not yet run on a TPU.
_FULL_K_UNALIGNED = True


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def weight_geometry(k: int, n: int, segments: int, itemsize: int):
    """(rows_per_segment, n_cols, block_k, block_n) for a [k, n] weight."""
    ks = k // segments
    bn = min(1024 if n >= 8192 else 512, _round_up(n, 128))
    n_cols = _round_up(n, bn)
    if ks % 128 == 0:
        rows = ks
    elif _FULL_K_UNALIGNED and segments == 1 and ks * bn * itemsize <= _W_TILE_BYTES:
        rows = ks  # one K block spanning the full K: legal without padding
    else:
        rows = _round_up(ks, 128)
    if rows % 128:
        bk = rows
    else:
        fits = [d for d in range(128, rows + 1, 128)
                if rows % d == 0 and d * bn * itemsize <= _W_TILE_BYTES]
        bk = max(fits) if fits else 128
    return rows, n_cols, bk, bn


def _kernel(*refs, tiles_per_seg, n_k, inv_ks, eps, precision, has_bias, has_init, multi_seg):
    x_ref, w_ref, b_ref, rest = split_refs(refs, has_bias, has_init)
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
    w = w_ref[...]
    if w.dtype != x.dtype:
        w = w.astype(x.dtype)
    seg_ref[...] += jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision)
    xf = x.astype(jnp.float32)
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


def run(x2, fw, bias, *, eps, interpret=False, poison=None):
    """x2 [M, K]; fw a FoldedWeight in the "tpu" layout; returns [M, N]."""
    m, k = x2.shape
    s, n = fw.segments, fw.n
    ks = k // s
    rows, n_cols, bk, bn = weight_geometry(k, n, s, jnp.dtype(fw.w.dtype).itemsize)
    assert fw.w.shape == (s * rows, n_cols), (fw.w.shape, rows, n_cols)
    x_item = jnp.dtype(x2.dtype).itemsize
    sub = 8 if x_item >= 4 else 16
    bm = _round_up(m, sub) if m <= _MAX_BM else _MAX_BM
    m_pad = _round_up(m, bm)

    xp = x2
    if rows != ks:
        xp = jnp.pad(xp.reshape(m, s, ks), ((0, 0), (0, 0), (0, rows - ks))).reshape(m, s * rows)
    if m_pad != m:
        xp = jnp.pad(xp, ((0, m_pad - m), (0, 0)))

    tiles_per_seg = rows // bk
    n_k = s * tiles_per_seg
    grid = (m_pad // bm, n_cols // bn, n_k)
    multi_seg = s > 1
    precision = jax.lax.Precision.HIGHEST if x2.dtype == jnp.float32 else None

    args = [xp, fw.w]
    in_specs = [pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))]
    out_spec = pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j))
    if bias is not None:
        b = bias.reshape(1, n)
        if n_cols != n:
            b = jnp.pad(b, ((0, 0), (0, n_cols - n)))
        args.append(b)
        in_specs.append(pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)))
    aliases = {}
    if poison is not None:
        aliases = {len(args): 0}
        args.append(jnp.full((m_pad, n_cols), poison, x2.dtype))
        in_specs.append(out_spec)

    scratch = [pltpu.VMEM((bm, bn), jnp.float32)]
    if multi_seg:
        scratch.append(pltpu.VMEM((bm, bn), jnp.float32))
    scratch.append(pltpu.VMEM((bm, bn), jnp.float32))

    w_item = jnp.dtype(fw.w.dtype).itemsize
    vmem_need = (2 * (bm * bk * x_item + bk * bn * w_item + 8 * bn * 4)
                 + 2 * bm * bn * x_item + len(scratch) * bm * bn * 4)
    vmem_limit = int(min(max(2 * vmem_need, 32 * 2**20), 48 * 2**20))

    kernel = functools.partial(
        _kernel, tiles_per_seg=tiles_per_seg, n_k=n_k, inv_ks=1.0 / ks, eps=eps,
        precision=precision, has_bias=bias is not None, has_init=poison is not None,
        multi_seg=multi_seg)
    cost = pl.CostEstimate(
        flops=2 * m_pad * s * rows * n_cols,
        transcendentals=m_pad * n_cols * s,
        bytes_accessed=(xp.size * x_item + fw.w.size * w_item + m_pad * n_cols * x_item))
    if interpret:
        interpret = pltpu.InterpretParams()
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n_cols), x2.dtype),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        scratch_shapes=scratch,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit),
        cost_estimate=cost,
        interpret=interpret,
        name="fused_norm_matmul_tpu",
    )(*args)
    if (m_pad, n_cols) != (m, n):
        out = out[:m, :n]
    return out
