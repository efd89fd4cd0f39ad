"""The Pallas path does no weight-sized work per call (issue 20).

The norm gains scale the activations inside the kernel, so a call hands the
caller's [K, N] weight straight to the kernel: no fold (g[:, None] * W), no
padding or re-layout. Checked structurally on the real lowerings (Mosaic for
TPU, Mosaic GPU for CUDA, lowered to StableHLO on CPU with ``impl="pallas"``):
outside the kernel's custom call, no op of a decode step may produce a value
as large as a weight. A fold, a pad, a transpose or a slice of a weight would.
The GPU kernel pads the activations to its 64-row tile, a [64, K] value at
most as large as a 64-column weight: the test models are wide enough (256)
that it stays below their smallest projection.
"""

from __future__ import annotations

import importlib
import math
import re

import jax
import jax.numpy as jnp
import pytest

from eagle_jax.config import DrafterConfig, TargetConfig
from eagle_jax.kernels import fused_norm_matmul
from eagle_jax.models import drafter, target

fnm = importlib.import_module("eagle_jax.kernels.fused_norm_matmul")

PLATFORMS = {"tpu": "tpu", "cuda": "gpu"}  # lowering platform -> kernel target
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "mosaic_gpu"}
# The models' dtype per platform: the GPU kernel takes 16-bit x and w (wgmma has no IEEE f32).
DTYPE = {"tpu": jnp.float32, "cuda": jnp.bfloat16}
# Ops that only pass values along (the kernel call itself, loops, calls) are not work on a weight.
_FORWARDING = {"stablehlo.custom_call", "stablehlo.while", "call", "func.call", "stablehlo.return",
               "func.return", "stablehlo.optimization_barrier", "stablehlo.tuple",
               "stablehlo.get_tuple_element"}
_OP = re.compile(r'^\s*%[\w#:]+ = "?([\w.]+)')
_TENSOR = re.compile(r"tensor<((?:\d+x)*)[a-z]")


def weight_sized_ops(module_text: str, min_elements: int) -> list[str]:
    """The ops of a StableHLO module (text) with a result of >= min_elements elements,
    forwarding ops excepted: one line (op name and result types) each."""
    found = []
    for line in module_text.splitlines():
        op = _OP.match(line)
        if not op or op.group(1) in _FORWARDING:
            continue
        results = line.rsplit("->", 1)[1] if "->" in line else line.rsplit(" : ", 1)[-1]
        if any(math.prod(int(d) for d in dims.split("x") if d) >= min_elements
               for dims in _TENSOR.findall(results)):
            found.append(f"{op.group(1)} -> {results.strip()[:120]}")
    return found


@pytest.fixture(params=sorted(PLATFORMS))
def platform(request, monkeypatch):
    """A lowering platform, with impl='pallas' accepted on this CPU host for its kernel target."""
    monkeypatch.delenv(fnm.ENV_VAR, raising=False)
    monkeypatch.setattr(fnm, "_backend_target", lambda: PLATFORMS[request.param])
    return request.param


def _lower(fn, platform, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _sds(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


# (M, K, N, segments, dtype): decode and verify rows; for TPU also N and segment lengths that tile
# nothing evenly (the GPU kernel refuses those: N and segments multiples of 64, 16-bit dtypes).
CASES = [(1, 576, 960, 1, "bfloat16"), (5, 1728, 576, 3, "float32"), (3, 600, 1100, 3, "bfloat16"),
         (1, 576, 49152, 1, "bfloat16"), (2, 100, 130, 1, "float32"), (5, 1728, 576, 3, "float16"),
         (12, 576, 3072, 1, "bfloat16")]


def _tiles_on(platform, case) -> bool:
    _, k, n, s, dt = case
    return platform == "tpu" or (dt != "float32" and n % 64 == 0 and (k // s) % 64 == 0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}-K{}-N{}-S{}-{}".format(*c))
def test_kernel_call_does_nothing_weight_sized(case, platform):
    if not _tiles_on(platform, case):
        pytest.skip("a shape or dtype the GPU kernel refuses (test_fused_norm_matmul checks the error)")
    m, k, n, s, dt = case
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    fn = lambda x, g, w, b: fused_norm_matmul(x, g, w, eps=1e-5, segments=s, bias=b, impl="pallas")
    g_shape = (k,) if s == 1 else (s, k // s)
    text = _lower(fn, platform, sd(m, k), sd(*g_shape), sd(k, n), sd(n))
    assert KERNEL_CALL[platform] in text
    assert weight_sized_ops(text, k * n) == []


def test_counter_sees_a_fold(platform):
    """Control: folding the gains into W before the call is the op the check exists to catch."""
    k, n = 1728, 576
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, DTYPE[platform])
    fn = lambda x, g, w: fused_norm_matmul(x, jnp.ones_like(g), g[:, None] * w, eps=1e-5, segments=3,
                                           impl="pallas")
    found = weight_sized_ops(_lower(fn, platform, sd(1, k), sd(k), sd(k, n)), k * n)
    assert "stablehlo.multiply" in {f.split(" ")[0] for f in found}


def _target(tied: bool, platform: str):
    cfg = TargetConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=64, max_position_embeddings=64, tie_word_embeddings=tied)
    return cfg, target.init_params(cfg, jax.random.PRNGKey(0), dtype=DTYPE[platform])


def _decode_step_text(cfg, params, platform):
    """StableHLO of one target decode step (B=1, T=1: forward + logits) with impl='pallas'."""
    cache = target.create_cache(cfg, 1, 16, DTYPE[platform])

    def step(params, cache, tok, pos):
        model = target.Target(cfg, params)
        h, cache, _ = model(tok, pos, cache, impl="pallas")
        return model.logits(h, impl="pallas"), cache

    tok = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return _lower(step, platform, _sds(params), _sds(cache), tok, tok)


def _smallest_weight(params) -> int:
    """Elements of the smallest projection matrix in params (one layer's; norm gains
    excluded); the test models keep every activation and cache below it."""
    return min(math.prod(a.shape[-2:]) for a in jax.tree.leaves(params)
               if a.ndim >= 2 and min(a.shape[-2:]) >= 128)


def test_target_decode_step_unrolled(platform):
    cfg, params = _target(tied=False, platform=platform)
    params = target.unstack_layers(params)
    text = _decode_step_text(cfg, params, platform)
    assert weight_sized_ops(text, _smallest_weight(params)) == []


def test_target_decode_step_tied_embedding(platform):
    """A tied lm_head is made once by prepare_for_decoding, not transposed per call."""
    cfg, params = _target(tied=True, platform=platform)
    params = target.prepare_for_decoding(params, cfg, impl="pallas", unroll=True)
    assert weight_sized_ops(_decode_step_text(cfg, params, platform), _smallest_weight(params)) == []


def test_target_decode_step_scanned(platform):
    """Under lax.scan the kernels take each stacked [L, K, N] projection whole and
    read the layer's blocks in place (`LayerWeight`); the plain projections (o,
    down) are XLA dots on the layer's dynamic slice, which XLA may fuse into the
    dot: they are the only weight-sized ops left, and none feeds a kernel."""
    cfg, params = _target(tied=False, platform=platform)
    found = weight_sized_ops(_decode_step_text(cfg, params, platform), _smallest_weight(params))
    shapes = {tuple(int(d) for d in dims.split("x") if d) for f in found for dims in _TENSOR.findall(f)}
    o, down = (cfg.q_size, cfg.hidden_size), (cfg.intermediate_size, cfg.hidden_size)
    assert shapes == {(1, *o), o, (1, *down), down}, found  # the slice and its squeeze, per plain projection
    assert {f.split(" ")[0] for f in found} == {"stablehlo.dynamic_slice", "stablehlo.reshape"}, found


def test_drafter_step_with_fc_norm(platform):
    """EAGLE 3.1: fc_norm over 3 aux segments, the two-segment qkv norm, the draft head."""
    cfg = DrafterConfig(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
                        vocab_size=1024, draft_vocab_size=512, target_hidden_size=256,
                        aux_layer_ids=(0, 1, 2), fc_norm=True, norm_output=True)
    dtype = DTYPE[platform]
    params = drafter.init_params(cfg, jax.random.PRNGKey(0), dtype=dtype)
    embed = jax.ShapeDtypeStruct((1024, 256), dtype)
    cache = drafter.create_cache(cfg, 1, 16, dtype)

    def step(params, embed, cache, aux, tok, pos):
        model = drafter.Drafter(cfg, params)
        logits, fb, cache = model.step(tok, model.project_features(aux, impl="pallas"), pos, cache, embed=embed,
                                       impl="pallas")
        return logits, fb, cache

    tok = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    aux = jax.ShapeDtypeStruct((1, 1, 3 * 256), dtype)
    text = _lower(step, platform, _sds(params), embed, _sds(cache), aux, tok, tok)
    assert weight_sized_ops(text, _smallest_weight(params)) == []
