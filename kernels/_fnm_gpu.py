"""GPU (Triton, through `pl.pallas_call` + `pltriton.CompilerParams`) lowering.

Grid (N/bn, M/bm), one program per output tile (W is [K, N], or [L, K, N]
with the layer index an int32 operand the program reads, so a scanned layer's
weight is read in place); the K reduction is a
`fori_loop` inside the program (a GPU grid has no sequential axis to carry an
accumulator across programs). The refs are the whole arrays (no BlockSpecs):
each program loads power-of-two tiles x [bm, bk] and W' [bk, bn] with masked
loads (``other=0``) at offsets it computes from its program ids, and writes
its [bm, bn] tile with a masked store, so M, N and the segment length need
not divide the blocks and nothing is read or written out of bounds.

Per segment s (a static Python loop, so a tile never straddles segments):
acc_s = sum_t (x_tile * g_tile) @ W_tile in f32 and ss_s = sum_t
rowsum(x_tile^2); then out += acc_s * rsqrt(ss_s / ks + eps). The gains
scale the [bm, bk] activation tile; W is read as given. f32 inputs use IEEE
f32 dots (precision HIGHEST, not TF32).

The same body runs under ``interpret=True`` on CPU (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from eagle_jax.kernels._refs import split_refs


# Enough programs to keep every SM of an H100/H200 (132 SMs) busy twice over.
_TARGET_PROGRAMS = 264


def block_sizes(m: int, n: int, ks: int, x_itemsize: int):
    """(bm, bn, bk, num_warps, num_stages); every block a power of two >= 16.

    Decode rows are few, so bm is the smallest power of two >= M (at least
    16, what a Triton dot needs); bn shrinks from 128 towards 32 until the
    grid has enough programs to spread the W stream over the SMs. Untuned
    heuristics: no GPU was available when they were written.
    """
    bm = min(64, max(16, pl.next_power_of_2(m)))
    m_blocks = pl.cdiv(m, bm)
    bn = 128
    while bn > 32 and pl.cdiv(n, bn) * m_blocks < _TARGET_PROGRAMS:
        bn //= 2
    cap = 128 if x_itemsize <= 2 else 64
    bk = cap
    while bk > 16 and ks % bk:
        bk //= 2
    if ks % bk:  # no power of two >= 16 divides ks: mask the last tile
        bk = cap
    bk = min(bk, max(16, pl.next_power_of_2(ks)))
    return bm, bn, bk, 4, 3


def _kernel(layer_ref, *refs, m, n, ks, segments, bm, bn, bk, eps, precision, has_bias, has_init, stacked):
    x_ref, g_ref, w_ref, b_ref, (o_ref,) = split_refs(refs, has_bias, has_init)
    # One indexer per load (Triton lowering takes no chained .at): the layer, when stacked, leads it.
    lead = (pltriton.load(layer_ref.at[pl.ds(0, 1)])[0],) if stacked else ()

    j = pl.program_id(0)
    i = pl.program_id(1)
    row0 = i * bm
    col0 = j * bn
    row_ok = (row0 + jnp.arange(bm)) < m
    col_ok = (col0 + jnp.arange(bn)) < n
    n_tiles = pl.cdiv(ks, bk)

    out = jnp.zeros((bm, bn), jnp.float32)
    for s in range(segments):
        def body(t, carry, s=s):
            acc, ss = carry
            k_ok = (t * bk + jnp.arange(bk)) < ks
            k0 = s * ks + t * bk
            xt = pltriton.load(x_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)],
                               mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            gt = pltriton.load(g_ref.at[pl.ds(k0, bk)], mask=k_ok, other=0.0)
            wt = pltriton.load(w_ref.at[(*lead, pl.ds(k0, bk), pl.ds(col0, bn))],
                               mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if wt.dtype != xt.dtype:
                wt = wt.astype(xt.dtype)
            xf = xt.astype(jnp.float32)
            xg = (xf * gt.astype(jnp.float32)[None, :]).astype(xt.dtype)
            acc = acc + jax.lax.dot(xg, wt, precision=precision,
                                    preferred_element_type=jnp.float32)
            ss = ss + jnp.sum(xf * xf, axis=1)
            return acc, ss

        acc, ss = jax.lax.fori_loop(
            0, n_tiles, body,
            (jnp.zeros((bm, bn), jnp.float32), jnp.zeros((bm,), jnp.float32)))
        out = out + acc * jax.lax.rsqrt(ss * (1.0 / ks) + eps)[:, None]

    if has_bias:
        b = pltriton.load(b_ref.at[pl.ds(col0, bn)], mask=col_ok, other=0.0)
        out = out + b.astype(jnp.float32)[None, :]
    pltriton.store(o_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)], out.astype(o_ref.dtype),
                   mask=row_ok[:, None] & col_ok[None, :])


def run(x2, g, w, bias, *, segments, eps, interpret=False, poison=None, blocks=None, layer=None):
    """x2 [M, K], g [K] or [S, K/S], w [K, N] (or [L, K, N] with layer an int32
    scalar), bias [N] or None -> [M, N] in x2.dtype."""
    m, k = x2.shape
    s, n = segments, w.shape[-1]
    ks = k // s
    bm, bn, bk, num_warps, num_stages = blocks or block_sizes(
        m, n, ks, jnp.dtype(x2.dtype).itemsize)
    precision = jax.lax.Precision.HIGHEST if x2.dtype == jnp.float32 else None
    stacked = layer is not None
    args = [jnp.zeros((1,), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1),
            x2, g.reshape(k), w]
    if bias is not None:
        args.append(bias)
    aliases = {}
    if poison is not None:
        aliases = {len(args): 0}
        args.append(jnp.full((m, n), poison, x2.dtype))
    kernel = functools.partial(
        _kernel, m=m, n=n, ks=ks, segments=s, bm=bm, bn=bn, bk=bk,
        eps=eps, precision=precision, has_bias=bias is not None, has_init=poison is not None, stacked=stacked)
    x_item = jnp.dtype(x2.dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n, transcendentals=m * s,
        bytes_accessed=x2.size * x_item + k * n * jnp.dtype(w.dtype).itemsize
        + m * n * x_item)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x2.dtype),
        grid=(pl.cdiv(n, bn), pl.cdiv(m, bm)),
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        cost_estimate=cost,
        interpret=bool(interpret),
        name="fused_norm_matmul_gpu",
    )(*args)
