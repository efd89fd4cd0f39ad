"""fused_norm_matmul: y = concat_s(rms_norm(x_s) * g_s) @ w (+ bias).

Shapes: x [..., K]; norm_weights [K] (one norm, or the per-segment norms laid
end to end) or [S, K//S] (one norm per segment of the feature axis); w [K, N]
(or `LayerWeight`: layer l of a stacked [L, K, N] weight, which the Pallas
kernels read in place); bias [N] or None. Accumulation in float32; the result has
`out_dtype` (default x's dtype), rounded once (the Pallas kernels store it so).

Implementations (``impl``):

* ``"xla"``: `rms_norm_matmul_reference`, plain jnp (the path the models use on
  CPU). It normalises in f32, casts back to x.dtype, multiplies by gamma (like
  HF RMSNorm) and runs one dot with f32 accumulation. Differentiated by JAX.
* ``"pallas"``: a Pallas kernel compiled for the current backend: Mosaic on
  TPU (`_fnm_tpu`), Mosaic GPU on GPU (`_fnm_gpu`: Hopper wgmma; bfloat16 /
  float16, N and the segment length multiples of 64). CPU cannot compile
  Pallas, so asking for it there raises ValueError.
* ``"interpret"``: the same Pallas kernel bodies run by the Pallas
  interpreters (on CPU, for tests): ``target="gpu"`` runs the Mosaic GPU
  body under the GPU interpreter, ``target="tpu"`` the Mosaic body under
  ``pltpu.InterpretParams``. The default is the backend's body, and on CPU
  the TPU's (the backend where ``auto`` is Pallas; it takes every shape).
  Under a multi-device context mesh the TPU body runs under Pallas's generic
  HLO interpreter instead: the TPU simulator's per-device bookkeeping
  deadlocks in the in-process collectives of simulated CPU devices.
* ``"native"``: the C++ CPU kernels (`eagle_jax.kernels.cpu`), which run on
  weights packed once by `cpu.pack_weight` (`PackedWeight`): the norm is the
  XLA reference's, the matmul streams the packed weight once for all rows.
  A `PackedWeight` always takes this path, whatever ``impl`` says; a plain
  weight under ``"native"`` takes the XLA path (packing per call would cost
  more than it saves). Decoding packs its weights when `resolve_impl` says
  ``"native"`` (`eagle_jax.models.target.prepare_for_decoding`).
* ``"auto"``: ``pallas`` on TPU; ``xla`` on GPU, until the Mosaic GPU kernel
  is measured faster than XLA there (none has been: no GPU has been lent;
  `benchmarks/device_check.py` times both); on CPU ``native`` when the C++
  library builds and loads here, else ``xla``. `auto_impl(backend)` is that
  rule.

The environment variable ``EAGLE_JAX_KERNEL_IMPL`` (one of the impl names)
overrides ``impl`` for every call.

How the kernels compute it (deferred normalisation): with r_s =
rsqrt(mean(x_s^2) + eps) for each segment s, y = sum_s r_s * ((x_s * g_s) @ W_s)
+ b. The kernel streams the raw weight W once; the gains multiply the
activation tile in VMEM / registers ([M, K] work, nothing weight-sized), and
per segment it accumulates the f32 partial product and the row sum of
squares of x; r_s scales the segment's partial product when its last K tile
has been seen. No call folds gamma into W or re-lays out W (both would be a
pass over the weight per call that jit cannot hoist, W being an argument),
so trained norms (the drafter's `fc_norm`) and the PyTorch export keep their
weights as they are.

Gradients: the Pallas impls carry a `jax.custom_vjp` whose backward pass is
the VJP of the XLA reference (recomputing the norm in plain jnp), giving
gradients wrt x, norm_weights, w and bias.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.kernels import cpu
from eagle_jax.kernels.cpu import PackedWeight

IMPLS = ("auto", "xla", "pallas", "interpret", "native")
TARGETS = ("gpu", "tpu")
ENV_VAR = "EAGLE_JAX_KERNEL_IMPL"
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

@dataclasses.dataclass(frozen=True)
class LayerWeight:
    """Layer `layer` (an int32 scalar, traced under `lax.scan`) of a stacked
    weight `stack` [L, K, N]. The Pallas kernels take the stack whole and read
    that layer's blocks by index, so a scanned decoder hands them no copy of a
    layer; the XLA paths index it (`get`)."""

    stack: jax.Array
    layer: jax.Array

    def get(self) -> jax.Array:
        """The [K, N] weight of the layer."""
        return self.stack[self.layer]


jax.tree_util.register_dataclass(LayerWeight, data_fields=["stack", "layer"], meta_fields=[])


def _segment_rms_norm(x, norm_weights, *, eps, segments):
    """Normalise each segment in f32, cast back to x.dtype, scale by gamma (HF RMSNorm)."""
    k = x.shape[-1]
    xs = x.astype(jnp.float32).reshape(*x.shape[:-1], segments, k // segments)
    var = jnp.mean(jnp.square(xs), axis=-1, keepdims=True)
    g = norm_weights.reshape(segments, k // segments)
    normed = (xs * jax.lax.rsqrt(var + eps)).astype(x.dtype) * g.astype(x.dtype)
    return normed.reshape(x.shape)


def rms_norm_matmul_reference(x, norm_weights, w, *, eps, segments=1, bias=None, out_dtype=None, impl="xla"):
    """Plain-XLA path: normalise each segment in f32, scale, cast, matmul (`impl` as `matmul`'s)."""
    normed = _segment_rms_norm(x, norm_weights, eps=eps, segments=segments)
    return matmul(normed, w, bias, out_dtype=out_dtype, impl=impl)


def _add_bias(y, bias):
    return y if bias is None else y + bias.astype(jnp.float32)


def matmul(x, w, bias=None, *, out_dtype=None, residual=None, impl="auto"):
    """x [..., K] @ w (+ bias) with f32 accumulation, result in out_dtype
    (default x.dtype), rounded once; with `residual` [..., N] (in out_dtype),
    ``residual + that`` (a decoder layer's ``h + o_proj(attn)``).

    w is a [K, N] array or a `LayerWeight` (XLA dot, w cast to x.dtype; its
    gradient as `_dot` says for `impl`) or a `PackedWeight` (the native CPU
    kernel, the residual add inside it)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if isinstance(w, LayerWeight):
        w = w.get()
    if isinstance(w, PackedWeight) and bias is None and (residual is None or residual.dtype == out_dtype):
        return cpu.matmul(x, w, out_dtype=out_dtype, residual=residual)
    if isinstance(w, PackedWeight):
        y = cpu.matmul(x, w)
    else:
        y = _dot(x, w.astype(x.dtype), impl)
    y = _add_bias(y, bias).astype(out_dtype)
    return y if residual is None else residual + y


def _dot(x, w, impl):
    """x [..., K] @ w [K, N] (one dtype), accumulated and returned in f32.

    In bf16 where `impl` resolves to the native CPU kernels, off a multi-device
    mesh, the gradient is `_dot_rowmajor`'s: autodiff's backward dots take the
    f32 cotangent and a transposed operand, and XLA:CPU runs either as an f32
    dot (benchmarks/results/analysis.md, "Training twice as fast on CPU")."""
    if x.dtype == jnp.bfloat16 and resolve_impl(impl) == "native" and _multi_device_mesh() is None:
        return _dot_rowmajor(x, w)
    return _dot_f32(x, w)


def _dot_f32(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


_dot_rowmajor = jax.custom_vjp(_dot_f32)  # the same product, with `_dot_rowmajor_bwd` as its gradient


def _dot_rowmajor_fwd(x, w):
    return _dot_f32(x, w), (x, w)


def _dot_rowmajor_bwd(res, g):
    """dx = g @ w.T [..., K] and dw = x.T @ g [K, N] as row-major bf16 dots (f32
    sums) on copies transposed by the native kernel, which XLA cannot fold back
    into the dots; the f32 cotangent g [..., N] is rounded to bf16 first, as
    mixed-precision training does."""
    x, w = res
    k, n = w.shape
    g2 = g.reshape(-1, n).astype(x.dtype)
    dx = jnp.dot(g2, cpu.transpose(w), preferred_element_type=jnp.float32)
    dw = jnp.dot(cpu.transpose(x.reshape(-1, k)), g2, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype).reshape(x.shape), dw.astype(w.dtype)


_dot_rowmajor.defvjp(_dot_rowmajor_fwd, _dot_rowmajor_bwd)


def norm_swiglu(x, norm_weights, w_gate_up, *, eps, groups=1, impl="auto"):
    """silu(gate) * up of rms_norm(x) @ [gate | up]: [..., K] -> [..., N/2] in x.dtype;
    with `groups` > 1 the columns are that many groups of [gate | up] (a model-parallel
    layout) and the result is in the usual order.

    On a `PackedWeight` whose halves tile evenly, one native call does the
    norm, both projections and the product."""
    if isinstance(w_gate_up, PackedWeight):
        if groups != 1:
            raise ValueError("the native swiglu takes [gate | up] in one group")
        if _native_fuses(x, w_gate_up, None) and cpu.fuses_swiglu(w_gate_up):
            return cpu.matmul(x, w_gate_up, x.dtype, norm_weight=norm_weights, eps=eps, swiglu=True)
    gu = fused_norm_matmul(x, norm_weights, w_gate_up, eps=eps, impl=impl)
    gu = gu.reshape(*gu.shape[:-1], groups, 2, gu.shape[-1] // (2 * groups))
    return (jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]).reshape(*gu.shape[:-3], -1)


def _native_fuses(x, w: PackedWeight, bias) -> bool:
    """Whether the native kernel can take this norm + projection in one call."""
    return bias is None and jnp.dtype(x.dtype) == jnp.dtype(w.dtype) and cpu.fuses_norm(w)


# ---------------------------------------------------------------------------
# Validation and dispatch
# ---------------------------------------------------------------------------


def _check_segments(segments):
    if isinstance(segments, bool) or not isinstance(segments, (int, np.integer)) or segments < 1:
        raise ValueError(f"segments must be a positive int, got {segments!r}")


def _check_norm_weights(norm_weights, k, segments):
    """norm_weights [K] or [S, K/S], else a one-line ValueError."""
    if norm_weights is None:
        raise ValueError("norm_weights is required: the gains are applied to x inside the kernel")
    g = jnp.asarray(norm_weights)
    ks = k // segments
    if g.shape not in ((k,), (segments, ks)):
        allowed = f"[{k}]" if segments == 1 else f"[{k}] or [{segments}, {ks}]"
        raise ValueError(
            f"norm_weights must be {allowed} for K={k} and segments={segments}, got shape {g.shape}")
    return g


def auto_impl(backend: str) -> str:
    """What ``impl="auto"`` runs on `backend` (a `jax.default_backend()` name):
    Pallas (Mosaic) on TPU; XLA on GPU until the Mosaic GPU kernel is measured
    faster there; on CPU the native kernels when they load, else XLA."""
    if backend == "tpu":
        return "pallas"
    if backend == "cpu":
        return "native" if cpu.available() else "xla"
    return "xla"


def resolve_impl(impl: str) -> str:
    """The impl that runs: ``$EAGLE_JAX_KERNEL_IMPL`` over ``impl``, "auto" resolved."""
    forced = os.environ.get(ENV_VAR)
    source = "the impl argument"
    if forced:
        impl, source = forced, f"${ENV_VAR}"
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel impl {impl!r} (from {source}); expected one of {IMPLS}")
    if impl == "auto":
        return auto_impl(jax.default_backend())
    if impl == "native":
        cpu.require()
    return impl


def _backend_target():
    backend = jax.default_backend()
    if backend == "tpu":
        return "tpu"
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    return None


def _resolve_target(impl: str, target):
    if target is not None and target not in TARGETS:
        raise ValueError(f"unknown kernel target {target!r}; expected one of {TARGETS} or None")
    here = _backend_target()
    if impl == "pallas":
        if here is None:
            raise ValueError(
                f"impl='pallas' needs a GPU or TPU backend, but the backend is "
                f"{jax.default_backend()!r}; use impl='interpret' (tests) or 'xla'")
        if target is not None and target != here:
            raise ValueError(f"target={target!r} cannot be compiled on the {here!r} backend; "
                             f"use impl='interpret' to run that kernel body")
        return here
    return target or here or "tpu"  # off an accelerator: the body `auto` runs on TPU


@dataclasses.dataclass(frozen=True)
class _Config:
    eps: float
    segments: int
    target: str
    interpret: bool | str  # False (compiled), True (the body's simulator) or "hlo" (`fused_norm_matmul`)
    out_dtype: jnp.dtype  # the kernel's output: the f32 accumulator rounded once, or kept (logits)
    poison: float | None  # the TPU body's output buffer is filled with it first (None: not preset)


def fused_norm_matmul(x, norm_weights, w, *, eps, segments=1, bias=None, impl="auto", target=None,
                      out_dtype=None, column_axis: str | None = "model", poison: float | None = None):
    """RMSNorm (per segment) followed by a projection. See module docstring.

    ``out_dtype`` (default x.dtype) is the result's dtype; float32 keeps the
    accumulator unrounded (logits). ``w`` is a [K, N] array, a `LayerWeight`
    (one layer of a stacked weight) or a `PackedWeight`.
    ``target`` ("gpu" or "tpu") picks which Pallas kernel body an
    ``interpret`` run uses; for ``pallas`` it must match the backend.
    Under a context mesh (`jax.set_mesh`) the Pallas kernel runs on each
    device's block (`_on_mesh`): rows on the mesh's ``data`` axis and w's
    columns on ``column_axis`` (None: w is replicated), as `eagle_jax.sharding`
    lays them out; the XLA path is partitioned by XLA.
    ``poison`` (the TPU kernel body): its output buffer is filled with this value
    first and aliased to the output, so an element the kernel fails to write
    keeps it (the kernel tests pass NaN).
    """
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError("x must be [..., K], got a scalar")
    if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    _check_segments(segments)
    segments = int(segments)
    k = x.shape[-1]
    if isinstance(w, PackedWeight):
        if w.k != k:
            raise ValueError(f"PackedWeight has K={w.k}, but x has K={k}")
        n = w.n
        wdtype = w.dtype
    elif isinstance(w, LayerWeight):
        if w.stack.ndim != 3 or w.stack.shape[1] != k or jnp.shape(w.layer) != ():
            raise ValueError(f"a LayerWeight must be a stacked [L, K={k}, N] weight and a scalar layer, "
                             f"got shapes {w.stack.shape} and {jnp.shape(w.layer)}")
        n = w.stack.shape[2]
        wdtype = w.stack.dtype
    else:
        w = jnp.asarray(w)
        if w.ndim != 2 or w.shape[0] != k:
            raise ValueError(f"w must be [K={k}, N], got shape {w.shape}")
        n = w.shape[1]
        wdtype = w.dtype
    if not jnp.issubdtype(wdtype, jnp.floating):
        raise ValueError(f"w must be floating point, got {wdtype}")
    if k % segments:
        raise ValueError(f"K={k} is not divisible into {segments} segments")
    norm_weights = _check_norm_weights(norm_weights, k, segments)
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (n,):
            raise ValueError(f"bias must be [N={n}], got shape {bias.shape}")
    try:
        eps = float(eps)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError(f"eps must be a Python float, got {eps!r}") from e
    impl = resolve_impl(impl)

    if isinstance(w, PackedWeight):
        if _native_fuses(x, w, bias):
            return cpu.matmul(x, w, x.dtype if out_dtype is None else out_dtype,
                              norm_weight=norm_weights.reshape(k), eps=eps, segments=segments)
        normed = _segment_rms_norm(x, norm_weights, eps=eps, segments=segments)
        return matmul(normed, w, bias, out_dtype=out_dtype)
    if impl in ("xla", "native"):
        return rms_norm_matmul_reference(x, norm_weights, w, eps=eps, segments=segments, bias=bias,
                                         out_dtype=out_dtype, impl=impl)
    stack, layer = (w.stack, w.layer.astype(jnp.int32)) if isinstance(w, LayerWeight) else (w, None)

    target = _resolve_target(impl, target)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return jnp.zeros((*lead, n), out_dtype or x.dtype)
    on_mesh = _multi_device_mesh() is not None
    if impl == "interpret" and target == "gpu" and on_mesh:
        raise ValueError("the Mosaic GPU interpreter is not run under a multi-device mesh (the TPU simulator, "
                         "built the same way, deadlocks in the simulated devices' collectives); use "
                         "target='tpu' or impl='xla'")
    interpret = impl == "interpret" and ("hlo" if on_mesh else True)
    cfg = _Config(eps=eps, segments=segments, target=target, interpret=interpret,
                  out_dtype=jnp.dtype(out_dtype or x.dtype), poison=poison)
    y = _on_mesh(functools.partial(_pallas_apply, cfg), x2, norm_weights, stack, bias, layer, column_axis,
                 batch=lead[0] if lead else x2.shape[0])
    return y.reshape(*lead, n)


def _multi_device_mesh():
    """The context mesh (`jax.set_mesh`) when it spans more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


def _on_mesh(apply, x2, g, w, bias, layer, column_axis, batch):
    """apply(x2 [M, K], g, w [..., K, N], bias [N] or None, layer) -> [M, N], on each device's
    block under the context mesh (`shard_map`): the rows split on its ``data`` axis where that
    divides `batch` (x's leading dimension, whose blocks the M rows follow: the blocks of the
    batch's data sharding, not a split of some batch rows between devices) and w's columns
    (with the bias and the result's) on `column_axis` where it divides them, so no device
    gathers a weight (a column-parallel projection needs no collective).
    Without a context mesh of more than one device, `apply` as it is."""
    from jax.sharding import PartitionSpec as P

    mesh = _multi_device_mesh()
    if mesh is None:
        return apply(x2, g, w, bias, layer)

    def axis(name, size):
        return name if name in mesh.axis_names and size % mesh.shape[name] == 0 else None

    rows, cols = axis("data", batch), axis(column_axis, w.shape[-1])
    values = (x2, g, w, bias, layer)
    specs = (P(rows, None), P(), P(*[None] * (w.ndim - 1), cols), P(cols), P())
    given = [i for i, v in enumerate(values) if v is not None]  # shard_map maps arrays, not None

    def local(*arrays):
        block = dict(zip(given, arrays))
        return apply(*(block.get(i) for i in range(len(values))))

    return jax.shard_map(local, in_specs=tuple(specs[i] for i in given), out_specs=P(rows, cols),
                         check_vma=False)(*(values[i] for i in given))


# ---------------------------------------------------------------------------
# Pallas path with custom VJP
# ---------------------------------------------------------------------------


def _math_reference(cfg: _Config, x2, g, w, bias, layer):
    """What the kernel computes, in plain jnp (the backward pass)."""
    w = w if layer is None else w[layer]
    return rms_norm_matmul_reference(x2, g, w, eps=cfg.eps, segments=cfg.segments, bias=bias,
                                     out_dtype=cfg.out_dtype)


def _pallas_forward(cfg: _Config, x2, g, w, bias, layer):
    """x2 [M, K], g [K] or [S, K/S], w [K, N] (or [L, K, N] and the int32 scalar
    layer) as given (never copied), bias [N] or None -> [M, N]."""
    from eagle_jax.kernels import _fnm_gpu, _fnm_tpu

    if cfg.target == "gpu":  # the GPU interpreter already fills unwritten memory with NaN
        return _fnm_gpu.run(x2, g, w, bias, segments=cfg.segments, eps=cfg.eps, interpret=cfg.interpret,
                            layer=layer, out_dtype=cfg.out_dtype)
    return _fnm_tpu.run(x2, g, w, bias, segments=cfg.segments, eps=cfg.eps, interpret=cfg.interpret,
                        poison=cfg.poison, layer=layer, out_dtype=cfg.out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pallas_apply(cfg, x2, g, w, bias, layer):
    return _pallas_forward(cfg, x2, g, w, bias, layer)


def _pallas_apply_fwd(cfg, x2, g, w, bias, layer):
    return _pallas_forward(cfg, x2, g, w, bias, layer), (x2, g, w, bias, layer)


def _pallas_apply_bwd(cfg, res, dy):
    x2, g, w, bias, layer = res
    _, vjp = jax.vjp(lambda *a: _math_reference(cfg, *a, layer), x2, g, w, bias)
    return (*vjp(dy), None)


_pallas_apply.defvjp(_pallas_apply_fwd, _pallas_apply_bwd)
