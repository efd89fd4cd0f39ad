"""GPU lowering: a Mosaic GPU kernel (`plgpu.kernel`, warpgroup semantics, Hopper `wgmma`).

Grid (M/64, N/bn): one block, one warpgroup, per [64, bn] output tile; decode
rows are few, so x is zero-padded to 64 rows (activation-sized; the pad rows
are dropped). Per segment s (a static Python loop), `plgpu.emit_pipeline`
streams the segment's K tiles by TMA into 128-byte-swizzled shared memory:
the x tile [64, 64], the gains [64] and the W tile [64, bn], several steps in
flight. The body reads the x tile into registers, adds its squares to the
row sums ss_s, writes x * g back over the same shared-memory slot, fences it
for the tensor cores (`commit_smem`) and issues `wgmma(acc_s, x * g, W)` into
an f32 accumulator. When the segment's last tile is in, the tile adds
acc_s * rsqrt(ss_s / ks + eps); then the bias (copied to shared memory at the
start) and one TMA store through shared memory. The gains scale the
activation tile; W is read as given, never folded or re-laid out.

A stacked weight [L, K, N] is read in place: the layer index is copied to
shared memory (four int32: TMA moves at least 16 bytes) and the pipeline
streams `w.at[layer]`.

What `wgmma` and the swizzled layouts allow, and so what this kernel takes:
a Hopper GPU (H100, H200: compute capability 9.x); x and W of one dtype, bfloat16 or float16 (wgmma has no IEEE float32 path:
float32 operands would run as TF32); N and the segment length multiples of
64. Anything else is a one-line ValueError naming the shape; the XLA path
(`impl="xla"`) takes every shape and dtype.

Layout casts (`plgpu.layout_cast`) are hints for Mosaic GPU's layout
inference; the GPU interpreter (`interpret=True`, CPU tests) has no rule for
them and they carry no values, so it runs the body without them. The
interpreter fills unwritten memory with NaN, so a tile the grid misses shows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # one warpgroup's wgmma tile height
K_TILE = 64  # 128 bytes of a 16-bit dtype: the 128-byte swizzle
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Enough blocks to keep every SM of an H100/H200 (132 SMs) busy twice over.
_TARGET_BLOCKS = 264
_MAX_STEPS_IN_FLIGHT = 4
_WGMMA = plgpu.Layout.WGMMA


def block_cols(m: int, n: int) -> int:
    """bn: 128 where N divides into enough 128-wide blocks, else 64. Untuned:
    no GPU was available when it was written."""
    blocks_128 = pl.cdiv(m, ROWS) * (n // 128)
    return 128 if n % 128 == 0 and blocks_128 >= _TARGET_BLOCKS else 64


def check_shapes(x_dtype, w_dtype, n: int, ks: int) -> None:
    """One-line ValueError unless this kernel tiles the problem (module docstring)."""
    if jnp.dtype(x_dtype) not in DTYPES or jnp.dtype(w_dtype) != jnp.dtype(x_dtype):
        raise ValueError(
            f"the Mosaic GPU kernel takes x and w of one dtype, bfloat16 or float16 (wgmma has no "
            f"IEEE float32 path), got {jnp.dtype(x_dtype)} and {jnp.dtype(w_dtype)}; use impl='xla'")
    if n % 64 or ks % K_TILE:
        raise ValueError(
            f"the Mosaic GPU kernel needs N and the segment length to be multiples of 64, got "
            f"N={n} and segment length {ks}; use impl='xla'")


def _swizzled(cols: int, dtype):
    """Tiling + swizzle transforms for a [rows, cols] shared-memory tile of `dtype`."""
    item = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(cols * item * 8)
    return plgpu.TilingTransform((8, swizzle // item)), plgpu.SwizzleTransform(swizzle)


def check_device() -> None:
    """One-line ValueError unless the default device is a Hopper GPU (compute
    capability 9.x): `wgmma` exists nowhere else (not on Ampere, not on Blackwell)."""
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    if cc is not None and not str(cc).startswith("9."):
        raise ValueError(f"the Mosaic GPU kernel needs a Hopper GPU (wgmma, compute capability 9.x), but "
                         f"{dev.device_kind} has {cc}; use impl='xla'")


def interpret_params():
    """The GPU interpreter's parameters (exported from jax 0.11; jax 0.10 keeps them private)."""
    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls()


def _kernel(layer_g, x_g, g_g, w_g, *refs, segments, ks, bn, eps, has_bias, stacked, interpret):
    b_g, o_g = refs if has_bias else (None, refs[0])
    dtype, out_dtype = x_g.dtype, o_g.dtype
    steps = ks // K_TILE
    i = jax.lax.axis_index("m")
    j = jax.lax.axis_index("n")
    cast = (lambda v, layout: v) if interpret else plgpu.layout_cast

    def scoped(layer_s, bias_s, out_s, barriers):
        if stacked:
            plgpu.copy_gmem_to_smem(layer_g, layer_s, barriers.at[0])
            plgpu.barrier_wait(barriers.at[0])
            w = w_g.at[layer_s[0]]
        else:
            w = w_g
        if has_bias:
            plgpu.copy_gmem_to_smem(b_g.at[pl.ds(j * bn, bn)], bias_s, barriers.at[1])

        def segment(s, acc):
            def body(_, x_s, g_s, w_s, ss):
                xf = cast(x_s[...], _WGMMA).astype(jnp.float32)
                ss = ss + jnp.sum(xf * xf, axis=1)
                gains = jax.lax.broadcast_in_dim(cast(g_s[...], _WGMMA.reduce(0)), (ROWS, K_TILE), (1,))
                x_s[...] = (xf * gains.astype(jnp.float32)).astype(dtype)
                plgpu.commit_smem()
                plgpu.wgmma(acc, x_s, w_s)
                plgpu.wgmma_wait(0)
                return ss

            first = s * steps
            ss = plgpu.emit_pipeline(
                body, grid=(steps,),
                in_specs=[plgpu.BlockSpec((ROWS, K_TILE), lambda t: (i, first + t), transforms=_swizzled(K_TILE, dtype)),
                          plgpu.BlockSpec((K_TILE,), lambda t: (first + t,)),
                          plgpu.BlockSpec((K_TILE, bn), lambda t: (first + t, j), transforms=_swizzled(bn, dtype))],
                max_concurrent_steps=min(steps, _MAX_STEPS_IN_FLIGHT),
                init_carry=cast(jnp.zeros((ROWS,), jnp.float32), _WGMMA.reduce(1)))(x_g, g_g, w)
            scale = jax.lax.rsqrt(ss * (1.0 / ks) + eps)
            return acc[...] * jax.lax.broadcast_in_dim(scale, (ROWS, bn), (0,))

        out = None
        for s in range(segments):
            part = pl.run_scoped(functools.partial(segment, s), plgpu.ACC((ROWS, bn), jnp.float32))
            out = part if out is None else out + part
        if has_bias:
            plgpu.barrier_wait(barriers.at[1])
            bias = cast(bias_s[...], _WGMMA.reduce(0)).astype(jnp.float32)
            out = out + jax.lax.broadcast_in_dim(bias, (ROWS, bn), (1,))
        out_s[...] = out.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, o_g.at[pl.ds(i * ROWS, ROWS), pl.ds(j * bn, bn)])
        plgpu.wait_smem_to_gmem(0)

    bias_dtype = b_g.dtype if has_bias else dtype
    pl.run_scoped(scoped, plgpu.SMEM((4,), jnp.int32), plgpu.SMEM((bn,), bias_dtype),
                  plgpu.SMEM((ROWS, bn), out_dtype, transforms=_swizzled(bn, out_dtype)),
                  plgpu.Barrier(num_barriers=2))


def grid(m_pad: int, n: int, bn: int) -> tuple[int, int]:
    return m_pad // ROWS, n // bn


def run(x2, g, w, bias, *, segments, eps, interpret=False, layer=None, out_dtype=None):
    """x2 [M, K], g [K] or [S, K/S], w [K, N] (or [L, K, N] with layer an int32
    scalar), bias [N] or None -> [M, N] in out_dtype (default x2.dtype: the f32
    accumulator is rounded once, in the kernel; float32 leaves it unrounded)."""
    m, k = x2.shape
    n = w.shape[-1]
    ks = k // segments
    check_shapes(x2.dtype, w.dtype, n, ks)
    if not interpret:
        check_device()
    m_pad = pl.cdiv(m, ROWS) * ROWS
    bn = block_cols(m, n)
    stacked = layer is not None
    layer4 = jnp.full((4,), 0 if layer is None else layer, jnp.int32)
    x_pad = x2 if m_pad == m else jnp.pad(x2, ((0, m_pad - m), (0, 0)))
    args = [layer4, x_pad, g.reshape(k).astype(x2.dtype), w]
    if bias is not None:
        args.append(bias)
    kernel = functools.partial(_kernel, segments=segments, ks=ks, bn=bn, eps=eps, has_bias=bias is not None,
                               stacked=stacked, interpret=bool(interpret))
    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((m_pad, n), x2.dtype if out_dtype is None else out_dtype),
        grid=grid(m_pad, n, bn), grid_names=("m", "n"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params() if interpret else None)
    y = call(*args)
    return y if m_pad == m else y[:m]
