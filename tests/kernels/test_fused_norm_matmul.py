"""Tests for eagle_jax.kernels.fused_norm_matmul.

The Pallas kernel bodies run under the Pallas interpreters on CPU (the
Mosaic GPU body under the GPU interpreter, the TPU / Mosaic body under
``pltpu.InterpretParams``) and are compared with a float64 NumPy reference.
Every TPU run gets an output buffer pre-filled with NaN (aliased to the
output), and the GPU interpreter fills unwritten memory with NaN itself, so a
tile a kernel fails to write shows up as NaN; outputs are checked to be
NaN-free (the TPU interpreter also fills the out-of-bounds part of a partial
block with NaN, so garbage read past N must stay in the columns that are
dropped). The compiled lowerings (Mosaic for TPU, Mosaic GPU for CUDA, down
to the GPU kernel's wgmma instructions) are exercised with cross-platform
lowering, which needs no accelerator and checks the block and layout rules.
"""

from __future__ import annotations

import functools
import importlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels import LayerWeight, rms_norm_matmul_reference

fnm = importlib.import_module("eagle_jax.kernels.fused_norm_matmul")
fnm_tpu = importlib.import_module("eagle_jax.kernels._fnm_tpu")
fnm_gpu = importlib.import_module("eagle_jax.kernels._fnm_gpu")
# The TPU body writes into a NaN-filled output buffer: an element it fails to write stays NaN.
fused_norm_matmul = functools.partial(fnm.fused_norm_matmul, poison=float("nan"))

EPS = 1e-6
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
on_cpu = jax.default_backend() == "cpu"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(fnm.ENV_VAR, raising=False)


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _inputs(key, lead, m, k, n, segments, dtype, bias, g_2d=None):
    """Random non-zero inputs; rows get different scales so the norm matters."""
    rng = _rng(*key)
    x = rng.standard_normal((*lead, m, k)) * rng.uniform(0.2, 5.0, (*lead, m, 1))
    ks = k // segments
    g_2d = segments > 1 if g_2d is None else g_2d
    g_shape = (segments, ks) if g_2d else (k,)
    g = rng.uniform(0.25, 1.75, g_shape) * rng.choice([-1.0, 1.0], g_shape)
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    b = rng.standard_normal(n) if bias else None
    cast = lambda a: None if a is None else jnp.asarray(a, dtype)
    return cast(x), cast(g), cast(w), cast(b)


def _ref64(x, g, w, segments, b=None, eps=EPS):
    f64 = lambda a: None if a is None else np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    x, g, w, b = f64(x), f64(g), f64(w), f64(b)
    k = x.shape[-1]
    xs = x.reshape(*x.shape[:-1], segments, k // segments)
    normed = xs / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + eps) * g.reshape(segments, -1)
    y = normed.reshape(x.shape) @ w
    return y if b is None else y + b


def _check(y, ref, dtype, x_dtype=None):
    assert y.dtype == jnp.dtype(x_dtype or dtype)
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    assert y.shape == ref.shape
    assert not np.isnan(y).any(), "output has NaN (unwritten tile or bad math)"
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < TOL[jnp.dtype(dtype).name], rel


def _run(x, g, w, b, segments, impl, target=None):
    f = jax.jit(lambda x, g, w, b: fused_norm_matmul(
        x, g, w, eps=EPS, segments=segments, bias=b, impl=impl, target=target))
    return f(x, g, w, b)


def _check_kernel(x, g, w, b, segments, dt, target):
    """The interpreted kernel against float64 and against the XLA impl."""
    y = _run(x, g, w, b, segments, "interpret", target)
    _check(y, _ref64(x, g, w, segments, b), dt)
    _check(y, np.asarray(jnp.asarray(_run(x, g, w, b, segments, "xla"), jnp.float32), np.float64), dt)
    return y


# (lead, M, K, N, segments, bias, dtype): the shapes the GPU kernel takes (16-bit, N and the segment
# length multiples of 64); rows past one 64-row tile, several column blocks, one K tile per segment.
# The GPU interpreter simulates each block's threads: few blocks keep it to seconds a case.
GPU_CASES = [
    ((), 1, 576, 192, 1, True, "bfloat16"),
    ((), 7, 1728, 128, 3, False, "bfloat16"),
    ((2,), 31, 192, 256, 3, True, "float16"),  # 62 rows; segment length 64: one K tile
    ((), 67, 576, 64, 1, True, "bfloat16"),  # two row tiles, the second padded
    ((), 16, 1152, 192, 2, False, "float16"),
]


def _case_id(c):
    lead, m, k, n, s, bias, dt = c
    return f"lead{'x'.join(map(str, lead)) or '0'}-M{m}-K{k}-N{n}-S{s}-{'bias' if bias else 'nobias'}-{dt}"


@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_kernel_interpret(case):
    lead, m, k, n, s, bias, dt = case
    x, g, w, b = _inputs(("gpu", case), lead, m, k, n, s, dt, bias)
    y = _check_kernel(x, g, w, b, s, dt, "gpu")
    assert y.shape == (*lead, m, n)


TPU_CASES = [
    ((), 7, 576, 200, 1, True, "float32"),
    ((2,), 9, 1728, 1000, 3, True, "bfloat16"),  # N=1000: a partial last N block
    ((), 20, 1728, 300, 3, False, "float32"),
    ((), 1, 4096, 200, 1, False, "bfloat16"),
    ((), 3, 600, 1100, 3, True, "float32"),  # segment length 200 (not a multiple of 128)
    ((), 2, 100, 130, 1, True, "bfloat16"),  # K=100: one full-K block
    ((), 5, 1024, 8200, 2, False, "bfloat16"),  # N >= 8192: 1024-wide blocks, the last partial
]


@pytest.mark.parametrize("small_tiles", [False, True], ids=["default-tiles", "small-tiles"])
@pytest.mark.parametrize("case", TPU_CASES, ids=_case_id)
def test_tpu_kernel_interpret(case, small_tiles, monkeypatch):
    """The Mosaic body under pltpu.InterpretParams; small tiles force several
    M blocks, N blocks (partial ones) and K steps per segment."""
    lead, m, k, n, s, bias, dt = case
    if small_tiles:
        monkeypatch.setattr(fnm_tpu, "_W_TILE_BYTES", 64 * 1024)
        monkeypatch.setattr(fnm_tpu, "_MAX_BM", 16)
    x, g, w, b = _inputs(("tpu", case), lead, m, k, n, s, dt, bias)
    _check_kernel(x, g, w, b, s, dt, "tpu")


def test_tpu_blocks(monkeypatch):
    """Blocks tile the raw weight: bk divides the segment, N may end in a partial block."""
    assert fnm_tpu.block_sizes(1, 576, 960, 1, 2, 2) == (16, 576, 512)  # SmolLM2 qkv
    assert fnm_tpu.block_sizes(7, 1728, 576, 3, 4, 4) == (8, 576, 512)  # EAGLE fc: whole segments
    assert fnm_tpu.block_sizes(300, 4096, 49152, 1, 2, 2) == (256, 2048, 1024)
    assert fnm_tpu.block_sizes(3, 600, 200, 3, 4, 4)[1:] == (200, 200)
    monkeypatch.setattr(fnm_tpu, "_W_TILE_BYTES", 64 * 1024)
    assert fnm_tpu.block_sizes(20, 1728, 1000, 3, 4, 4)[1:] == (576, 128)  # 8 N blocks, last partial
    assert fnm_tpu.block_sizes(1, 4096, 200, 1, 2, 2)[1:] == (128, 200)  # 32 K steps


@pytest.mark.parametrize("target", ["gpu", "tpu"])
def test_float32_out_is_the_unrounded_accumulator(target):
    """out_dtype=float32 (the logits) leaves the f32 accumulator of a bf16 product
    unrounded: most entries fall between bf16 values, and the result is closer
    to the float64 reference than its own bf16 rounding."""
    x, g, w, b = _inputs(("f32-out", target), (), 5, 576, 192, 1, "bfloat16", True)
    y = jax.jit(lambda x, g, w, b: fused_norm_matmul(x, g, w, eps=EPS, bias=b, impl="interpret",
                                                     target=target, out_dtype=jnp.float32))(x, g, w, b)
    assert y.dtype == jnp.float32
    ref = _ref64(x, g, w, 1, b)
    y64 = np.asarray(y, np.float64)
    rounded = np.asarray(y.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    assert np.mean(y64 != rounded) > 0.9
    assert np.abs(y64 - ref).mean() < np.abs(rounded - ref).mean()
    _check(y, ref, "bfloat16", x_dtype="float32")


# --------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------

# (target, lead, M, K, N, segments, bias, dtype, out_dtype): float32 out is the lm_heads' (logits)
GRAD_CASES = [
    ("gpu", (2,), 7, 1728, 128, 3, True, "bfloat16", None),
    ("gpu", (), 5, 576, 192, 1, True, "float16", None),
    ("tpu", (), 3, 1728, 200, 3, True, "float32", None),
    ("tpu", (), 2, 1728, 1000, 3, True, "bfloat16", None),
    ("gpu", (), 16, 1024, 64, 1, False, "bfloat16", None),
    ("gpu", (), 3, 576, 192, 1, False, "bfloat16", "float32"),
    ("tpu", (), 3, 576, 200, 1, False, "bfloat16", "float32"),
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c[0] + "-" + _case_id(c[1:8]) + f"-out-{c[8]}")
def test_gradients_match_reference(case):
    target, lead, m, k, n, s, bias, dt, out = case
    x, g, w, b = _inputs(("grad", case), lead, m, k, n, s, dt, bias)
    ct = jnp.asarray(_rng("ct", case).standard_normal((*lead, m, n)), out or dt)
    argnums = (0, 1, 2, 3) if bias else (0, 1, 2)

    def loss(fn):
        def f(x, g, w, b):
            return jnp.sum((fn(x, g, w, b) * ct).astype(jnp.float32))
        return jax.jit(jax.grad(f, argnums=argnums))

    got = loss(lambda x, g, w, b: fused_norm_matmul(
        x, g, w, eps=EPS, segments=s, bias=b, impl="interpret", target=target, out_dtype=out))(x, g, w, b)
    want = loss(lambda x, g, w, b: rms_norm_matmul_reference(
        x, g, w, eps=EPS, segments=s, bias=b, out_dtype=out))(x, g, w, b)
    for name, a, c in zip("x g w b".split(), got, want):
        assert a.shape == c.shape and a.dtype == c.dtype, name
        a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
        c = np.asarray(jnp.asarray(c, jnp.float32), np.float64)
        assert not np.isnan(a).any(), name
        rel = np.linalg.norm(a - c) / np.linalg.norm(c)
        assert rel < TOL[dt], (name, rel)


@pytest.mark.parametrize("target,m,k,n,s,dt", [
    ("gpu", 1, 576, 192, 1, "bfloat16"), ("gpu", 5, 1728, 128, 3, "float16"),
    ("tpu", 1, 576, 200, 1, "bfloat16"), ("tpu", 5, 1728, 1000, 3, "float32")])
def test_layer_of_a_stacked_weight(target, m, k, n, s, dt):
    """A `LayerWeight` (layer l of [L, K, N], l traced as under lax.scan): each
    kernel body reads that layer in place and gives what the layer's own [K, N]
    weight gives; the gradient reaches only that layer of the stack."""
    x, g, _, b = _inputs(("stacked", target, m), (), m, k, n, s, dt, True)
    stack = jnp.asarray(_rng("stack", k, n).standard_normal((3, k, n)) / np.sqrt(k), dt)
    run = jax.jit(lambda x, g, st, b, l: fused_norm_matmul(
        x, g, LayerWeight(st, l), eps=EPS, segments=s, bias=b, impl="interpret", target=target))
    for layer in (0, 2):
        y = run(x, g, stack, b, jnp.int32(layer))
        _check(y, _ref64(x, g, stack[layer], s, b), dt)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(_run(x, g, stack[layer], b, s, "interpret", target)))
    grad = jax.jit(jax.grad(lambda st: jnp.sum(run(x, g, st, b, jnp.int32(1)).astype(jnp.float32))))(stack)
    assert np.any(np.asarray(grad[1], np.float32) != 0) and not np.any(np.asarray(grad[0::2], np.float32))


# --------------------------------------------------------------------------
# XLA path
# --------------------------------------------------------------------------

XLA_CASES = [
    ((), 1, 576, 200, 1, True, "float32"),
    ((2,), 7, 1728, 1000, 3, False, "float32"),
    ((), 67, 4096, 200, 1, True, "bfloat16"),
    ((3,), 31, 1728, 200, 3, True, "bfloat16"),
]


@pytest.mark.parametrize("case", XLA_CASES, ids=_case_id)
def test_xla_path_matches_numpy(case):
    lead, m, k, n, s, bias, dt = case
    x, g, w, b = _inputs(("xla", case), lead, m, k, n, s, dt, bias)
    _check(_run(x, g, w, b, s, "xla"), _ref64(x, g, w, s, b), dt)
    # [K]-shaped gains mean the same as [S, K/S].
    y1 = _run(x, g.reshape(-1), w, b, s, "xla")
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(_run(x, g, w, b, s, "xla")))


@pytest.mark.skipif(not on_cpu, reason="auto dispatch checked on CPU")
def test_auto_is_xla_on_cpu_and_env_forces(monkeypatch):
    x, g, w, b = _inputs(("auto",), (), 3, 576, 192, 1, "bfloat16", True)
    ref = rms_norm_matmul_reference(x, g, w, eps=EPS, bias=b)
    y = fused_norm_matmul(x, g, w, eps=EPS, bias=b)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    calls = []
    real = fnm._pallas_forward
    monkeypatch.setattr(fnm, "_pallas_forward", lambda *a: calls.append(a[0]) or real(*a))
    monkeypatch.setenv(fnm.ENV_VAR, "interpret")
    y2 = fused_norm_matmul(x, g, w, eps=EPS, bias=b, impl="xla")  # env var wins
    assert [c.interpret for c in calls] == [True]
    _check(y2, _ref64(x, g, w, 1, b), "bfloat16")


def test_gpu_interpreter_shows_unwritten_tiles(monkeypatch):
    """Sanity check of the harness: a grid that misses the last column block leaves NaN there."""
    x, g, w, _ = _inputs(("poison",), (), 5, 576, 192, 1, "bfloat16", False)
    real = fnm_gpu.grid
    monkeypatch.setattr(fnm_gpu, "grid", lambda m_pad, n, bn: (real(m_pad, n, bn)[0], n // bn - 1))
    y = np.asarray(jnp.asarray(fnm_gpu.run(x, g, w, None, segments=1, eps=EPS, interpret=True), jnp.float32))
    assert np.isnan(y[:, 128:]).all() and not np.isnan(y[:, :128]).any()


@pytest.mark.parametrize("dt, n, k, s, match", [
    ("float32", 192, 576, 1, r"x and w of one dtype, bfloat16 or float16 .* got float32 and float32"),
    ("bfloat16", 200, 576, 1, r"N and the segment length to be multiples of 64, got N=200 and segment length 576"),
    ("bfloat16", 192, 600, 3, r"got N=192 and segment length 200"),
])
def test_gpu_kernel_refuses_what_it_cannot_tile(dt, n, k, s, match):
    x, g, w, _ = _inputs(("refuse", dt, n, k), (), 2, k, n, s, dt, False)
    with pytest.raises(ValueError, match=match + r"; use impl='xla'"):
        fused_norm_matmul(x, g, w, eps=EPS, segments=s, impl="interpret", target="gpu")
    with pytest.raises(ValueError, match="x and w of one dtype"):
        fused_norm_matmul(x.astype(jnp.bfloat16), g, w.astype(jnp.float16), eps=EPS, segments=s,
                          impl="interpret", target="gpu")


# --------------------------------------------------------------------------
# Compiled lowerings, up to MLIR (no accelerator needed)
# --------------------------------------------------------------------------

# SmolLM2 qkv and lm_head (both column widths of the GPU kernel), the EAGLE fc, Llama 3.1 8B's
# lm_head and 70B's fc; TPU also an N that tiles nothing evenly.
LOWER_SHAPES = [(1, 576, 960, 1), (64, 576, 49152, 1), (16, 1728, 576, 3),
                (8, 4096, 128256, 1), (4, 12288, 4096, 3)]
LOWER = {"tpu": (LOWER_SHAPES + [(67, 4096, 1000, 1)], (("bfloat16", True), ("float32", False))),
         "cuda": (LOWER_SHAPES + [(67, 4096, 1024, 1)], (("bfloat16", True), ("float16", False)))}


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_lowers_for_accelerators(platform):
    mod = fnm_tpu if platform == "tpu" else fnm_gpu
    shapes, dtypes = LOWER[platform]
    # TPU: Mosaic's custom call; CUDA: Mosaic GPU's, its module down to the tensor-core wgmma
    wanted = ("tpu_custom_call",) if platform == "tpu" else ("mosaic_gpu", "wgmma.mma_async")

    def lower(m, k, n, s, dt, bias, out_dtype=None):
        sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
        f = lambda x, g, w, b: mod.run(x, g, w, b, segments=s, eps=EPS, out_dtype=out_dtype)
        lowered = jax.jit(f).trace(sd(m, k), sd(k), sd(k, n), sd(n) if bias else None).lower(
            lowering_platforms=(platform,))
        assert all(w in lowered.as_text() for w in wanted), (m, k, n, s, dt)
        return lowered

    for (m, k, n, s) in shapes:
        for dt, bias in dtypes:
            lower(m, k, n, s, dt, bias)
    # the logits: a bf16 product stored as float32 (the SmolLM2 and Llama 8B lm_heads)
    for (m, k, n, s) in (LOWER_SHAPES[1], LOWER_SHAPES[3]):
        assert lower(m, k, n, s, "bfloat16", False, jnp.float32).out_info.dtype == jnp.float32


# --------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------

def _ok():
    x, g, w, b = _inputs(("bad",), (), 2, 576, 200, 1, "float32", True)
    return x, g, w, b


@pytest.mark.parametrize("mutate, match", [
    (lambda x, g, w, b, kw: (x, g, w[:-1], b, kw), r"w must be \[K=576, N\]"),
    (lambda x, g, w, b, kw: (x, g, w[:, 0], b, kw), r"w must be \[K=576, N\]"),
    (lambda x, g, w, b, kw: (x, g, LayerWeight(w, jnp.int32(0)), b, kw),
     r"a LayerWeight must be a stacked \[L, K=576, N\] weight and a scalar layer"),
    (lambda x, g, w, b, kw: (x, g, LayerWeight(w[None], jnp.zeros((1,), jnp.int32)), b, kw),
     r"a LayerWeight must be a stacked \[L, K=576, N\] weight and a scalar layer"),
    (lambda x, g, w, b, kw: (x, g[:-1], w, b, kw), r"norm_weights must be \[576\]"),
    (lambda x, g, w, b, kw: (x, g.reshape(2, 288), w, b, {**kw, "segments": 3}),
     r"norm_weights must be \[576\] or \[3, 192\]"),
    (lambda x, g, w, b, kw: (x, g, w, b, {**kw, "segments": 5}), r"not divisible into 5 segments"),
    (lambda x, g, w, b, kw: (x, g, w, b, {**kw, "segments": 0}), r"segments must be a positive int"),
    (lambda x, g, w, b, kw: (x, g, w, b[:-1], kw), r"bias must be \[N=200\]"),
    (lambda x, g, w, b, kw: (x.astype(jnp.int32), g, w, b, kw), r"x must be float32, bfloat16"),
    (lambda x, g, w, b, kw: (x, g, w, b, {**kw, "impl": "cuda"}), r"unknown kernel impl 'cuda'"),
    (lambda x, g, w, b, kw: (x, g, w, b, {**kw, "impl": "interpret", "target": "npu"}),
     r"unknown kernel target 'npu'"),
    (lambda x, g, w, b, kw: (x, g, w, b, {**kw, "eps": None}), r"eps must be a Python float"),
])
def test_bad_inputs_raise(mutate, match):
    x, g, w, b, kw = mutate(*_ok(), {"eps": EPS})
    with pytest.raises(ValueError, match=match):
        fused_norm_matmul(x, g, w, bias=b, **kw)


def test_bad_env_var(monkeypatch):
    x, g, w, b = _ok()
    monkeypatch.setenv(fnm.ENV_VAR, "triton")
    with pytest.raises(ValueError, match=r"unknown kernel impl 'triton' \(from \$EAGLE_JAX_KERNEL_IMPL\)"):
        fused_norm_matmul(x, g, w, eps=EPS, bias=b)


def test_norm_weights_required():
    x, g, w, b = _ok()
    with pytest.raises(ValueError, match="norm_weights is required"):
        fused_norm_matmul(x, None, w, eps=EPS, impl="interpret")


def test_tpu_segment_length_not_blockable():
    rng = _rng("seg8")
    x, g = jnp.asarray(rng.standard_normal((2, 300)), jnp.float32), jnp.ones((300,))
    w = jnp.asarray(rng.standard_normal((300, 128)), jnp.float32)
    with pytest.raises(ValueError, match="segment length divisible by 8"):
        fused_norm_matmul(x, g, w, eps=EPS, segments=3, impl="interpret", target="tpu")


@pytest.mark.skipif(not on_cpu, reason="pallas compiles on accelerators")
def test_pallas_on_cpu_raises():
    x, g, w, b = _ok()
    with pytest.raises(ValueError, match="impl='pallas' needs a GPU or TPU"):
        fused_norm_matmul(x, g, w, eps=EPS, impl="pallas")


def test_gpu_kernel_needs_hopper(monkeypatch):
    """wgmma is Hopper's: on another GPU the compiled kernel is refused in one line."""
    class Ampere:
        device_kind, compute_capability = "NVIDIA A100-SXM4-80GB", "8.0"

    x, g, w, _ = _inputs(("hopper",), (), 2, 576, 192, 1, "bfloat16", False)
    monkeypatch.setattr(fnm_gpu.jax, "devices", lambda *a: [Ampere()])
    with pytest.raises(ValueError, match=r"needs a Hopper GPU .* A100-SXM4-80GB has 8.0; use impl='xla'"):
        fnm_gpu.run(x, g, w, None, segments=1, eps=EPS)
