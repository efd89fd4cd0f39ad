"""The native CPU kernels (kernels/cpu) against independent references.

matmul against a float64 NumPy product on awkward shapes (M 1..33, K and N
off the 64-column tile and odd K for bf16 pairs), with the output poisoned
so an unwritten element shows; the row-independence the greedy equivalence
rests on (each row bit-for-bit what a single-row call gives); each on the
AVX vectors and, where the CPU has them, on AMX tiles; attention,
with its q/k split, RoPE and Qwen3 norms, against the model's XLA path,
including the property that a key scores the same as a new token as it
later does from the cache; the in-place cache writes against the XLA
scatter; embedding rows against the clipped take; argmax against the XLA
greedy; the fallback without a compiler.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.cache import KVCache, causal_mask, committed_mask
from eagle_jax.config import RopeConfig
from eagle_jax.kernels import cpu, fused_norm_matmul, resolve_impl
from eagle_jax.models.layers import attend_after_write, rotate_qk, split_heads
from eagle_jax.nn import rope_tables

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"native kernels: {cpu.unavailable_reason()}")

# |error| bound relative to sum_k |x_k w_k| (f32 accumulation of exact products)
BOUND = {"float32": 2e-6, "bfloat16": 2e-6}


@pytest.fixture
def poisoned(monkeypatch):
    """cpu.matmul writing into a NaN-filled output buffer: an element it fails to write stays NaN."""
    matmul = cpu.matmul
    monkeypatch.setattr(cpu, "matmul", functools.partial(matmul, preset=float("nan")))


@pytest.fixture(params=["vectors", pytest.param("amx", marks=pytest.mark.skipif(
    not (cpu.available() and cpu.amx()), reason="no AMX tiles in this process"))])
def matmul_path(request, monkeypatch):
    """The bf16 matmuls on AVX vectors, or on AMX tiles (a process uses one for every call;
    the choice is made when a call is traced, so traces of the other path are dropped)."""
    monkeypatch.setitem(cpu._state, "amx", request.param == "amx")
    jax.clear_caches()
    yield request.param
    jax.clear_caches()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (5, 576, 3072), (7, 1536, 576), (13, 40, 70),
                                   (33, 17, 130), (2, 1, 3), (6, 65, 64), (12, 7, 129), (32, 64, 1),
                                   (100, 96, 200)])  # a prefill's rows: tasks split each tile's rows
def test_matmul_against_float64(poisoned, dtype, m, k, n, matmul_path):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    pw = cpu.pack_weight(w)
    np.testing.assert_array_equal(np.asarray(pw.unpack()), np.asarray(w))
    y = np.asarray(jax.jit(cpu.matmul)(x, pw))
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ref, scale = x64 @ w64, np.abs(x64) @ np.abs(w64)
    assert np.all(np.isfinite(y)), "an output element was not written"
    assert np.max(np.abs(y - ref) / (scale + 1e-30)) < BOUND[dtype] * max(1, k / 64)
    # bf16 output: the f32 result rounded once
    yb = jax.jit(lambda x, p: cpu.matmul(x, p, out_dtype=jnp.bfloat16))(x, pw)
    np.testing.assert_array_equal(np.asarray(yb), np.asarray(jnp.asarray(y).astype(jnp.bfloat16)))


def test_concurrent_calls_match_one_at_a_time(poisoned):
    """Kernel calls from several threads at once (the library's workers take one call at a
    time, the others run on XLA's pool) give the results of the same calls made alone."""
    import concurrent.futures

    rng = np.random.default_rng(5)
    pws = [cpu.pack_weight(jnp.asarray(rng.standard_normal((576, 960)), jnp.bfloat16)) for _ in range(4)]
    xs = [jnp.asarray(rng.standard_normal((m, 576)), jnp.bfloat16) for m in (1, 3, 5, 12)]
    f = jax.jit(cpu.matmul)
    alone = [np.asarray(f(x, pw)) for x, pw in zip(xs, pws)]

    def many(i):
        return [np.asarray(f(xs[i], pws[i])) for _ in range(25)]

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        for i, outs in enumerate(ex.map(many, range(4))):
            for y in outs:
                np.testing.assert_array_equal(y, alone[i])


def test_pack_weights_shares_one_block_and_matches_pack_weight():
    """Weights packed together (2D and stacked, both dtypes) equal each packed
    alone; a block of 2 MiB or more starts on a 2 MiB boundary (what lets the
    OS back it with huge pages) and the CPU arrays are that block, not copies."""
    rng = np.random.default_rng(3)
    ws = [jnp.asarray(rng.standard_normal((1536, 576)), jnp.bfloat16),  # 1.8 MB
          np.asarray(rng.standard_normal((65, 130)), np.float32),
          jnp.asarray(rng.standard_normal((3, 577, 70)), jnp.bfloat16)]
    packed = cpu.pack_weights(ws)
    for w, p in zip(ws[:2], packed[:2]):
        np.testing.assert_array_equal(np.asarray(p.data), np.asarray(cpu.pack_weight(w).data))
        np.testing.assert_array_equal(np.asarray(p.unpack()), np.asarray(w))
    stacked = packed[2]
    assert (stacked.k, stacked.n) == (577, 70)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(stacked.data[i]), np.asarray(cpu.pack_weight(ws[2][i]).data))
    start = packed[0].data.unsafe_buffer_pointer()
    assert start % (2 << 20) == 0
    assert packed[1].data.unsafe_buffer_pointer() == start + ws[0].size * 2  # 4 KiB-rounded, adjacent


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_rows_do_not_depend_on_m(dtype, matmul_path):
    """Row i of an M-row call equals the 1-row call on x[i], bit for bit, for every M."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((50, 576)), dtype)
    pw = cpu.pack_weight(jnp.asarray(rng.standard_normal((576, 200)) * 0.05, dtype))
    mm = jax.jit(cpu.matmul)
    singles = np.stack([np.asarray(mm(x[i:i + 1], pw))[0] for i in range(50)])
    for m in (2, 5, 6, 7, 12, 17, 50):
        np.testing.assert_array_equal(np.asarray(mm(x[:m], pw)), singles[:m])


def test_fused_norm_matmul_packed_equals_xla_reference():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 4, 96)), jnp.float32)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal((96,)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((96, 80)) * 0.1, jnp.float32)
    b = jnp.asarray(rng.standard_normal((80,)), jnp.float32)
    ref = fused_norm_matmul(x, g, w, eps=1e-5, bias=b, impl="xla")
    got = fused_norm_matmul(x, g, cpu.pack_weight(w), eps=1e-5, bias=b)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    seg = fused_norm_matmul(x, g.reshape(2, 48), cpu.pack_weight(w), eps=1e-5, segments=2)
    np.testing.assert_allclose(np.asarray(seg), np.asarray(
        fused_norm_matmul(x, g.reshape(2, 48), w, eps=1e-5, segments=2, impl="xla")), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("m,k,n,segments", [(1, 576, 960, 1), (5, 130, 200, 2), (17, 1152, 576, 2),
                                            (7, 48, 70, 3), (33, 64, 128, 1)])
def test_fused_norm_and_residual_against_the_xla_path(poisoned, dtype, m, k, n, segments, matmul_path):
    """The in-kernel RMSNorm rounds as the XLA path does (bf16: bit for bit but
    where f32 sums taken in another order round to the neighbouring value); the
    residual add is `h + round(x @ W)`."""
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal((k,)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, dtype)
    pw = cpu.pack_weight(w)
    ref = fused_norm_matmul(x, g, w, eps=1e-5, segments=segments, impl="xla")
    got = jax.jit(lambda x, g, p: cpu.matmul(x, p, jnp.dtype(dtype), norm_weight=g, eps=1e-5,
                                             segments=segments))(x, g, pw)
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    if dtype == "float32":
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    else:
        _assert_bf16_rounds_alike(np.asarray(got, np.float32), np.asarray(ref, np.float32))

    res = jnp.asarray(rng.standard_normal((m, n)), dtype)
    want = res + cpu.matmul(x, pw, jnp.dtype(dtype))
    got = jax.jit(lambda x, p, r: cpu.matmul(x, p, jnp.dtype(dtype), residual=r))(x, pw, res)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _assert_bf16_rounds_alike(got, ref):
    """Bit for bit except a few elements one bf16 step apart: the f32 accumulations differ in
    order (on a Zen 2 with AVX2 none differed; on a Xeon with AVX-512, 3 of 9,792 at
    17x1152x576), while a norm rounded once instead of twice moves about half of them."""
    off = got != ref
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 1e-30))) - 7)  # a bf16 ulp at |ref|
    assert off.mean() <= 0.005, f"{off.sum()} of {off.size} elements differ"
    assert np.all(np.abs(got - ref)[off] <= step[off]), np.max(np.abs(got - ref)[off] / step[off])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("m,k,f", [(1, 576, 1536), (6, 96, 64), (13, 130, 192), (49, 40, 128)])
def test_fused_swiglu_against_float64(poisoned, dtype, m, k, f, matmul_path):
    """silu(gate) * up from one call over [gate | up], against float64 math on
    the rounded factors (bf16: within one rounding of the output)."""
    rng = np.random.default_rng(m + k + f)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal((k,)), dtype)
    w = jnp.asarray(rng.standard_normal((k, 2 * f)) * 0.2, dtype)
    pw = cpu.pack_weight(w)
    got = jax.jit(lambda x, g, p: cpu.matmul(x, p, jnp.dtype(dtype), norm_weight=g, eps=1e-5, swiglu=True))(x, g, pw)
    gu = np.asarray(cpu.matmul(x, pw, jnp.dtype(dtype), norm_weight=g, eps=1e-5), np.float64)
    gate, up = gu[:, :f], gu[:, f:]
    ref = gate / (1 + np.exp(-gate)) * up
    tol = 1e-6 if dtype == "float32" else 2.0 ** -8
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=tol, atol=tol * 1e-2)


def test_fused_paths_keep_rows_independent_of_m(matmul_path):
    """Norm, residual and SwiGLU rows of an M-row call equal 1-row calls bit for bit."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((9, 128)), jnp.bfloat16)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal((128,)), jnp.bfloat16)
    pw = cpu.pack_weight(jnp.asarray(rng.standard_normal((128, 256)) * 0.1, jnp.bfloat16))
    f = jax.jit(lambda x: (cpu.matmul(x, pw, jnp.bfloat16, norm_weight=g, eps=1e-5, swiglu=True),
                           cpu.matmul(x, pw, jnp.bfloat16, residual=x.repeat(2, axis=-1))))
    singles = [f(x[i:i + 1]) for i in range(9)]
    for got, idx in ((f(x), slice(None)), (f(x[:5]), slice(0, 5))):
        for j in range(2):
            np.testing.assert_array_equal(np.asarray(got[j], np.float32),
                                          np.concatenate([np.asarray(s[j], np.float32) for s in singles])[idx])


def _attention_inputs(rng, dtype, b=2, t=5, hq=9, hkv=3, d=64, layers=3, s=48, lengths=(7, 33), qk_norm=False):
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    mask = jnp.asarray(rng.random((b, t, t)) < 0.5) | jnp.eye(t, dtype=bool)[None]
    positions = jnp.asarray(lengths, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)
    cos, sin = rope_tables(positions, RopeConfig(theta=10000.0), d)
    norms = (arr(d) * 0.1 + 1, arr(d) * 0.1 + 1) if qk_norm else None
    return dict(qkv=arr(b, t, (hq + 2 * hkv) * d), cos=cos, sin=sin, k_cache=arr(layers, b, hkv, s, d),
                v_cache=arr(layers, b, hkv, s, d), lengths=jnp.asarray(lengths, jnp.int32), new_mask=mask,
                num_heads=hq, qk_norm=norms)


def _native_attention(a, layer, slot_mask=None, **over):
    a = {**a, **over}
    run = jax.jit(lambda *x: cpu.attention(*x[:8], num_heads=a["num_heads"], qk_norm=a["qk_norm"], eps=1e-6,
                                           slot_mask=x[8]), static_argnums=5)
    return run(a["qkv"], a["cos"], a["sin"], a["k_cache"], a["v_cache"], layer, a["lengths"], a["new_mask"],
               slot_mask)


def _xla_attention(q, k, v, a, layer, slot_mask=None):
    """The models' XLA attention (`attend_after_write`) in float32 over layer `layer`
    of the inputs' cache, given T more slots so that no new key is dropped."""
    f32 = lambda x: x.astype(jnp.float32)
    t = q.shape[1]
    grow = lambda c: jnp.pad(f32(c[layer])[None], ((0, 0), (0, 0), (0, 0), (0, t), (0, 0)))
    cache = KVCache(grow(a["k_cache"]), grow(a["v_cache"]), a["lengths"])
    if slot_mask is None:
        slot_mask = committed_mask(a["lengths"], cache.max_len, t)
    else:
        slot_mask = jnp.pad(slot_mask, ((0, 0), (0, 0), (0, t)))
    return attend_after_write(f32(q), f32(k), f32(v), cache, 0, slot_mask, a["new_mask"], impl="xla")[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("t,d,lengths,qk_norm", [(1, 64, (7, 33), False), (5, 64, (0, 48), True),
                                                 (12, 128, (40, 3), False), (3, 64, (46, 47), True),
                                                 (200, 64, (0, 37), True)])  # a prefill chunk
def test_attention_against_xla(dtype, t, d, lengths, qk_norm):
    """Split, (Qwen3 q/k norms,) RoPE and attention in one call against the model's
    XLA path: layers.split_heads + rotate_qk + attend_after_write."""
    a = _attention_inputs(np.random.default_rng(t + d), dtype, t=t, d=d, lengths=lengths, qk_norm=qk_norm,
                          s=48 if t <= 12 else max(lengths) + t)
    out, k2, v2 = _native_attention(a, 1)
    q, k, v = split_heads(a["qkv"], a["num_heads"], a["k_cache"].shape[2], d)
    norms = a["qk_norm"] or (None, None)
    q, k = rotate_qk(q, k, a["cos"], a["sin"], q_norm=norms[0], k_norm=norms[1], eps=1e-6)
    f32 = lambda x: x.astype(jnp.float32)
    ref = _xla_attention(q, k, v, a, 1)
    tol = 2e-6 if dtype == "float32" else 1e-2  # bf16: the output is rounded to bf16
    np.testing.assert_allclose(np.asarray(f32(out)), np.asarray(ref), atol=tol, rtol=tol)
    # The rotated K and the V went to slots lengths[b] + t of layer 1 (past the end: dropped);
    # nothing else changed. bf16 keys may differ from XLA's rounding by one bf16 step.
    cache = KVCache(a["k_cache"], a["v_cache"], a["lengths"])
    want = cache.write(jnp.zeros_like(k)[None].repeat(3, 0).at[1].set(k),
                       jnp.zeros_like(v)[None].repeat(3, 0).at[1].set(v), impl="xla")
    for layer in range(3):
        expect_k = want.k[layer] if layer == 1 else a["k_cache"][layer]
        np.testing.assert_allclose(np.asarray(f32(k2[layer])), np.asarray(f32(expect_k)),
                                   rtol=2e-6 if dtype == "float32" else 2.0 ** -7, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(v2[layer]), np.asarray(
            want.v[layer] if layer == 1 else a["v_cache"][layer]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("t,lengths", [(1, (700, 255)), (4, (254, 513))])
def test_attention_over_long_contexts_against_xla(dtype, t, lengths):
    """Hundreds of cached keys, rows of a batch with very different lengths: the
    native attention equals the XLA attention."""
    a = _attention_inputs(np.random.default_rng(t), dtype, t=t, lengths=lengths, layers=2, s=max(lengths) + t + 5)
    out, _, _ = _native_attention(a, 1)
    q, k, v = split_heads(a["qkv"], a["num_heads"], a["k_cache"].shape[2], 64)
    q, k = rotate_qk(q, k, a["cos"], a["sin"])
    f32 = lambda x: x.astype(jnp.float32)
    ref = _xla_attention(q, k, v, a, 1)
    tol = 2e-6 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(f32(out)), np.asarray(ref), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_with_a_slot_mask_against_xla(dtype):
    """A per-query slot mask (the tree drafter's: committed slots plus a node's
    drafted ancestors) sees exactly the slots it allows, past `lengths` too."""
    rng = np.random.default_rng(11)
    a = _attention_inputs(rng, dtype, t=4, lengths=(20, 9))
    s = a["k_cache"].shape[3]
    slot_mask = jnp.asarray(rng.random((2, 4, s)) < 0.4).at[:, :, 30:].set(False).at[0, 2, 29].set(True)
    slot_mask = slot_mask.at[1].set(False)  # a row that sees no cache slot at all
    written = jnp.arange(s)[None] - a["lengths"][:, None]  # the slots this call writes: not in a slot mask
    slot_mask = slot_mask & ~((written >= 0) & (written < 4))[:, None, :]
    out, _, _ = _native_attention(a, 2, slot_mask=slot_mask)
    q, k, v = split_heads(a["qkv"], a["num_heads"], a["k_cache"].shape[2], 64)
    q, k = rotate_qk(q, k, a["cos"], a["sin"])
    f32 = lambda x: x.astype(jnp.float32)
    ref = _xla_attention(q, k, v, a, 2, slot_mask)
    tol = 2e-6 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(f32(out)), np.asarray(ref), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_key_scores_the_same_new_and_cached(dtype):
    """Verifying 4 tokens at once gives bit for bit what 4 one-token steps give."""
    rng = np.random.default_rng(5)
    a = _attention_inputs(rng, dtype, b=1, t=4, layers=1, s=64, lengths=(21,), qk_norm=True)
    together, _, _ = _native_attention(a, 0, new_mask=causal_mask(1, 4))
    kc, vc = a["k_cache"], a["v_cache"]
    for i in range(4):
        one, kc, vc = _native_attention(a, 0, qkv=a["qkv"][:, i:i + 1], cos=a["cos"][:, i:i + 1],
                                        sin=a["sin"][:, i:i + 1], k_cache=kc, v_cache=vc,
                                        lengths=a["lengths"] + i, new_mask=causal_mask(1, 1))
        np.testing.assert_array_equal(np.asarray(one[:, 0]), np.asarray(together[:, i]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_write_and_compact_equal_the_xla_scatter(dtype):
    rng = np.random.default_rng(7)
    shape = (2, 2, 3, 20, 16)  # [L, B, Hkv, S, D]
    cache = KVCache(jnp.asarray(rng.standard_normal(shape), dtype), jnp.asarray(rng.standard_normal(shape), dtype),
                    jnp.asarray([4, 17], jnp.int32))
    k_new = jnp.asarray(rng.standard_normal((2, 2, 5, 3, 16)), dtype)  # row 1 overflows the 20 slots
    v_new = jnp.asarray(rng.standard_normal((2, 2, 5, 3, 16)), dtype)
    for impl in ("native", "xla"):
        assert resolve_impl(impl) == impl
    a, b = cache.write(k_new, v_new, impl="native"), cache.write(k_new, v_new, impl="xla")
    np.testing.assert_array_equal(np.asarray(a.k), np.asarray(b.k))
    np.testing.assert_array_equal(np.asarray(a.v), np.asarray(b.v))
    # one layer's K/V into layer 1 (a traced index): that layer changes as the write of both, layer 0 not
    for impl in ("native", "xla"):
        one = jax.jit(lambda c, i: c.write(k_new[1:], v_new[1:], layer=i, impl=impl))(cache, jnp.int32(1))
        np.testing.assert_array_equal(np.asarray(one.k[1]), np.asarray(b.k[1]))
        np.testing.assert_array_equal(np.asarray(one.v[1]), np.asarray(b.v[1]))
        np.testing.assert_array_equal(np.asarray(one.k[0]), np.asarray(cache.k[0]))
        np.testing.assert_array_equal(np.asarray(one.v[0]), np.asarray(cache.v[0]))
    # the native write's gradient (a traced first layer) is the XLA scatter's
    def loss(k, kn, i, impl):
        written = cache.replace(k=k).write(kn, v_new[1:], layer=i, impl=impl)
        return jnp.sum(written.k.astype(jnp.float32) ** 2)

    grads = [jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=3)(cache.k, k_new[1:], jnp.int32(1), impl)
             for impl in ("native", "xla")]
    for a_leaf, b_leaf in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_array_equal(np.asarray(a_leaf), np.asarray(b_leaf))
    # ... and is what the write does: d/dk_new of sum(c * k) is c at each written slot of layer 1
    # (0 where the write fell past the end; 16-bit caches too, whose XLA write scatters bits)
    c = jnp.asarray(rng.standard_normal(shape), dtype)
    dkn = jax.grad(lambda kn: jnp.sum(cache.write(kn, v_new[1:], layer=1, impl="xla").k * c))(k_new[1:])
    want = np.zeros(k_new[1:].shape, np.float32)
    for b_row, length in enumerate(np.asarray(cache.lengths)):
        for t in range(k_new.shape[2]):
            if length + t < shape[3]:
                want[0, b_row, t] = np.asarray(c[1, b_row, :, length + t].astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(dkn.astype(jnp.float32)), want)
    src = jnp.asarray([[0, 2, 3, 0], [0, 1, 1, 2]], jnp.int32)
    n = jnp.asarray([3, 2], jnp.int32)
    a, b = a.compact(src, n, impl="native"), b.compact(src, n, impl="xla")
    np.testing.assert_array_equal(np.asarray(a.k), np.asarray(b.k))
    np.testing.assert_array_equal(np.asarray(a.v), np.asarray(b.v))
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embed_rows_equal_the_clipped_take(dtype):
    """Rows bit for bit as `jnp.take(mode="clip")`, ids out of range included."""
    table = jnp.asarray(np.random.default_rng(9).standard_normal((37, 24)), dtype)
    ids = jnp.asarray([[0, 36, 5], [-3, 40, 17]], jnp.int32)
    got = jax.jit(cpu.embed)(table, ids)
    assert got.shape == (2, 3, 24) and got.dtype == table.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.take(table, ids, axis=0, mode="clip")))


def test_argmax_equals_the_xla_path():
    """First maximal index per row, as ops.argmax's XLA path: ties,
    a NaN row, an all -inf row, V off the 16-lane vector."""
    from eagle_jax.kernels import ops

    x = np.random.default_rng(4).standard_normal((3, 5, 101)).astype(np.float32)
    x[0, 0, [7, 90]] = 50.0  # a tie: the first index wins
    x[0, 1, 100] = 60.0  # the maximum in the scalar tail
    x[1, 2, 3] = np.nan
    x[2, 4] = -np.inf
    x = jnp.asarray(x)
    got = jax.jit(cpu.argmax)(x)
    assert got.dtype == jnp.int32 and got.shape == (3, 5)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ops.argmax(x, impl="xla")))
    assert int(got[0, 0]) == 7 and int(got[0, 1]) == 100 and int(got[1, 2]) == 100


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize("shape", [(1, 1), (33, 65), (100, 7), (64, 96), (0, 5)])
def test_transpose_equals_numpy(dtype, shape):
    """Bit for bit, on shapes off the 32 x 32 block, for 4- and 2-byte elements."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal(shape) * 100, dtype)
    got = jax.jit(cpu.transpose)(x)
    assert got.shape == shape[::-1] and got.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x).T)


def test_bf16_matmul_gradient_runs_row_major_on_native_transposes():
    """The XLA-path `matmul` in bf16 differentiates through `_dot_rowmajor`:
    its gradient is autodiff's (of the same f32-accumulated dot) up to rounding
    the cotangent to bf16, and the compiled backward holds the native
    transposes, so XLA had no transpose to fold into a dot."""
    from eagle_jax.kernels import matmul

    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((2, 37, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 200)) * 0.1, jnp.float32)

    def loss(fn):
        return lambda x, w: jnp.sum(jnp.sin(fn(x, w.astype(jnp.bfloat16))))

    ours = jax.jit(jax.grad(loss(lambda x, w: matmul(x, w, out_dtype=jnp.float32)), argnums=(0, 1)))
    ref = jax.grad(loss(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)), argnums=(0, 1))
    for got, want in zip(ours(x, w), ref(x, w)):
        assert got.dtype == want.dtype
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.linalg.norm(got - want) <= 0.01 * np.linalg.norm(want)
    hlo = ours.lower(x, w).compile().as_text()
    assert hlo.count('custom_call_target="eagle_transpose"') == 2
    forward = jax.jit(loss(lambda x, w: matmul(x, w, out_dtype=jnp.float32))).lower(x, w).compile().as_text()
    assert "eagle_transpose" not in forward
    # not asked for: impl="xla", or f32 operands
    xla = jax.grad(loss(lambda x, w: matmul(x, w, out_dtype=jnp.float32, impl="xla")), argnums=(0, 1))
    assert "eagle_transpose" not in jax.jit(xla).lower(x, w).compile().as_text()
    f32 = jax.grad(lambda x, w: jnp.sum(jnp.sin(matmul(x, w, out_dtype=jnp.float32))), argnums=(0, 1))
    assert "eagle_transpose" not in jax.jit(f32).lower(x.astype(jnp.float32), w).compile().as_text()


def test_without_a_compiler_auto_falls_back_and_native_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    with pytest.raises(cpu.NativeKernelError, match="no C\\+\\+ compiler"):
        cpu.build()
    monkeypatch.setattr(cpu, "_state", {"error": "no C++ compiler found"})
    assert resolve_impl("auto") == "xla"
    with pytest.raises(cpu.NativeKernelError, match="no C\\+\\+ compiler"):
        resolve_impl("native")


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu.pack_weight(np.zeros((4, 4), np.float16))
    with pytest.raises(ValueError, match="K, N >= 1"):
        cpu.pack_weight(np.zeros((0, 130), np.float32))
    with pytest.raises(ValueError, match="K=8"):
        cpu.matmul(jnp.zeros((1, 5)), cpu.pack_weight(np.zeros((8, 4), np.float32)))
    with pytest.raises(ValueError, match="swiglu"):
        cpu.matmul(jnp.zeros((1, 8)), cpu.pack_weight(np.zeros((8, 96), np.float32)), swiglu=True)
    with pytest.raises(ValueError, match="even K"):
        cpu.matmul(jnp.zeros((1, 7), jnp.bfloat16), cpu.pack_weight(jnp.zeros((7, 4), jnp.bfloat16)),
                   norm_weight=jnp.ones((7,), jnp.bfloat16))
    with pytest.raises(ValueError, match="residual must be"):
        cpu.matmul(jnp.zeros((2, 8)), cpu.pack_weight(np.zeros((8, 4), np.float32)), residual=jnp.zeros((2, 5)))
    with pytest.raises(ValueError, match="2- or 4-byte"):
        cpu.transpose(jnp.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match="2- or 4-byte"):
        cpu.transpose(jnp.zeros((2, 3), jnp.int8))
    a = _attention_inputs(np.random.default_rng(0), "float32", d=32)
    with pytest.raises(ValueError, match="head_dim 64 or 128"):
        _native_attention(a, 0)
    a = _attention_inputs(np.random.default_rng(0), "float32")
    with pytest.raises(ValueError, match="qkv width 960 is not"):
        _native_attention(a, 0, num_heads=8)
