"""Drafter checkpoint import/export against an independent PyTorch reference.

The reference (torch_eagle_ref.py) is written from EAGLE.md, holds SafeAILab
PyTorch weights and writes its own config.json files; the JAX drafter must
reproduce its 3-step chain (fp32, ||diff|| / ||ref|| < 1e-5) after
`load_drafter`, and `save_drafter` must round-trip bit-exactly.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

from eagle_jax.config import ConfigError, RopeConfig, TargetConfig  # noqa: E402
from eagle_jax.convert.drafter_config import (  # noqa: E402
    drafter_config_from_dict,
    drafter_config_to_native,
    drafter_config_to_speculators,
)
from eagle_jax.convert.drafter_formats import (  # noqa: E402
    CheckpointError,
    load_drafter,
    save_drafter,
)
from eagle_jax.models.drafter import Drafter, create_cache, to_target_logits  # noqa: E402


def _load_ref():
    name = "torch_eagle_ref"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("torch_eagle_ref.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


ref_mod = _load_ref()
RefSpec, TorchEagleDrafter, run_chain = ref_mod.RefSpec, ref_mod.TorchEagleDrafter, ref_mod.run_chain

T = 6  # prompt positions at step 0
N_TARGET_LAYERS = 8  # default aux layers (2, 4, 5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _draft_ids(n: int, vocab: int, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    return tuple(int(i) for i in np.sort(rng.choice(vocab, size=n, replace=False)))


# name -> (RefSpec kwargs, native save kwargs, target rope: None = same as the drafter's).
# A config without rope keys (with_rope=False) runs at the Llama default theta 10000 without
# scaling, whatever the target uses (vLLM and the trainers): those variants give the target
# another RoPE so that inheriting it would fail.
TARGET_LLAMA3 = RopeConfig(theta=500000.0, scaling_type="llama3", factor=8.0,
                           original_max_position_embeddings=64)
VARIANTS = {
    "eagle3": (dict(rope_theta=500000.0, rope_scaling=LLAMA3), dict(), RopeConfig(theta=10000.0)),
    "eagle31": (dict(fc_norm=True, norm_output=True),
                dict(with_rope=False, with_aux_ids=False), TARGET_LLAMA3),
    "norm_before_fc": (dict(norm_before_fc=True), dict(with_rope=False, include_vocab=False),
                       RopeConfig(theta=20000.0)),
    "norm_before_residual": (dict(norm_before_residual=True, attention_bias=True), dict(), None),
    "target_hidden": (dict(target_hidden=48, has_embedding=True), dict(), None),
    "small_vocab": (dict(draft_vocab=120, draft_target_ids=_draft_ids(120, 300, 7)), dict(), None),
}


def _target_cfg(spec, rope: RopeConfig | None = None) -> TargetConfig:
    if rope is None:
        sc = spec.rope_scaling or {}
        rope = RopeConfig(theta=spec.rope_theta, scaling_type=sc.get("rope_type"),
                          **{k: v for k, v in sc.items() if k != "rope_type"})
    return TargetConfig(vocab_size=spec.vocab, hidden_size=spec.target_hidden, intermediate_size=96,
                        num_layers=N_TARGET_LAYERS, num_heads=4, num_kv_heads=2,
                        head_dim=spec.target_hidden // 4, max_position_embeddings=4096, rope=rope,
                        name_or_path="test/target")


def _build(name: str, seed: int = 0):
    spec_kw, save_kw, target_rope = VARIANTS[name]
    spec = RefSpec(**spec_kw)
    ref = TorchEagleDrafter(spec).randomize(seed)
    g = torch.Generator().manual_seed(seed + 100)
    aux = 2.0 * torch.randn(T, len(spec.aux_ids) * spec.target_hidden, generator=g)
    tokens = torch.randint(0, spec.vocab, (T,), generator=g)
    embed = None if spec.has_embedding else torch.randn(spec.vocab, spec.hidden, generator=g)
    return ref, save_kw, _target_cfg(spec, target_rope), aux, tokens, embed


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def jax_chain(cfg, params, vocab, aux, tokens, embed, next_tokens):
    """The same chain as torch_eagle_ref.run_chain, with the torch-chosen tokens."""
    t = tokens.shape[0]
    cache = create_cache(cfg, 1, t + len(next_tokens) + 1)
    model = Drafter(cfg, params)
    hidden = model.project_features(jnp.asarray(aux.numpy())[None])
    toks = jnp.asarray(tokens.numpy(), jnp.int32)[None]
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    e = None if embed is None else jnp.asarray(embed.numpy())
    outs = []
    for i, nxt in enumerate(next_tokens):
        logits, fb, cache = model.step(toks, hidden, pos, cache, embed=e)
        cache = cache.commit(jnp.array([toks.shape[1]], jnp.int32))
        outs.append((logits[0], to_target_logits(logits, vocab)[0], fb[0]))
        toks = jnp.array([[nxt]], jnp.int32)
        hidden = fb[:, -1:]
        pos = jnp.array([[t + i]], jnp.int32)
    return outs


def _assert_chain_matches(cfg, params, vocab, ref, aux, tokens, embed):
    torch_steps = run_chain(ref, aux, tokens, embed, steps=3)
    jax_steps = jax_chain(cfg, params, vocab, aux, tokens, embed, [s[3] for s in torch_steps])
    for i, ((t_lg, t_full, t_fb, t_next), (j_lg, j_full, j_fb)) in enumerate(zip(torch_steps, jax_steps)):
        t_full, j_full = t_full.numpy(), np.asarray(j_full)
        assert rel(j_lg, t_lg.numpy()) < 1e-5, f"step {i}: draft logits"
        assert rel(j_fb, t_fb.numpy()) < 1e-5, f"step {i}: feedback"
        assert np.array_equal(np.isneginf(j_full), np.isneginf(t_full)), f"step {i}: vocab map"
        finite = np.isfinite(t_full)
        assert rel(j_full[finite], t_full[finite]) < 1e-5, f"step {i}: target logits"
        j_next = int(np.asarray(vocab.target_ids)[int(np.argmax(np.asarray(j_lg)[-1]))])
        assert j_next == t_next, f"step {i}: next token"


# ----------------------------------------------------------------------------- equivalence

@pytest.mark.parametrize("fmt", ["native", "speculators"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chain_matches_torch_reference(tmp_path, variant, fmt):
    ref, save_kw, target_cfg, aux, tokens, embed = _build(variant)
    if fmt == "native":
        ref.save_native(tmp_path / "ckpt", **save_kw)
    else:
        ref.save_speculators(tmp_path / "ckpt", with_rope=save_kw.get("with_rope", True))
    cfg, params, vocab = load_drafter(tmp_path / "ckpt", target_cfg)
    s = ref.s
    assert (cfg.fc_norm, cfg.norm_before_fc, cfg.norm_output, cfg.norm_before_residual) == (
        s.fc_norm, s.norm_before_fc, s.norm_output, s.norm_before_residual)
    assert cfg.is_eagle31 == (variant == "eagle31")
    assert cfg.has_embedding == s.has_embedding
    assert cfg.aux_layer_ids == s.aux_ids
    assert cfg.max_position_embeddings == 4096  # raised to the target's
    _assert_chain_matches(cfg, params, vocab, ref, aux, tokens, embed)


def test_pytorch_model_bin_import(tmp_path):
    ref, _, target_cfg, aux, tokens, embed = _build("small_vocab", seed=3)
    ref.save_native(tmp_path / "bin", weights="bin")
    ref.save_native(tmp_path / "st")
    cfg_b, params_b, vocab_b = load_drafter(tmp_path / "bin", target_cfg)
    cfg_s, params_s, vocab_s = load_drafter(tmp_path / "st", target_cfg)
    assert cfg_b == cfg_s
    _assert_trees_equal(params_b, params_s)
    _assert_chain_matches(cfg_b, params_b, vocab_b, ref, aux, tokens, embed)


# ----------------------------------------------------------------------------- export

def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}/"))
        return out
    return {prefix[:-1]: np.asarray(tree)}


def _assert_trees_equal(a, b):
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape, k
        assert np.array_equal(fa[k].view(np.uint8), fb[k].view(np.uint8)), k


@pytest.mark.parametrize("fmt", ["speculators", "native"])
@pytest.mark.parametrize("variant", ["eagle31", "target_hidden", "small_vocab"])
def test_export_import_bit_exact(tmp_path, variant, fmt):
    ref, save_kw, target_cfg, *_ = _build(variant, seed=5)
    ref.save_native(tmp_path / "src", **save_kw)
    cfg, params, vocab = load_drafter(tmp_path / "src", target_cfg)
    save_drafter(tmp_path / "out", cfg, params, vocab, format=fmt)
    cfg2, params2, vocab2 = load_drafter(tmp_path / "out", target_cfg)
    assert cfg2 == cfg
    _assert_trees_equal(params2, params)
    assert np.array_equal(vocab2.d2t, vocab.d2t) and np.array_equal(vocab2.t2d, vocab.t2d)
    # Exporting the re-imported drafter reproduces the files byte for byte.
    save_drafter(tmp_path / "out2", cfg2, params2, vocab2, format=fmt)
    for f in ("config.json", "model.safetensors"):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "out2" / f).read_bytes(), f
    # The exported directory also loads without a target config (everything is explicit).
    cfg3, _, _ = load_drafter(tmp_path / "out")
    assert cfg3.replace(verifier_name_or_path=cfg.verifier_name_or_path) == cfg


def test_bf16_export_round_trip(tmp_path):
    ref, save_kw, target_cfg, *_ = _build("small_vocab", seed=2)
    ref.save_native(tmp_path / "src", **save_kw)
    cfg, params, vocab = load_drafter(tmp_path / "src", target_cfg)
    save_drafter(tmp_path / "bf16", cfg, params, vocab, dtype=jnp.bfloat16)
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("d2t").dtype == torch.int64
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    cfg2, params2, vocab2 = load_drafter(tmp_path / "bf16", target_cfg, dtype=jnp.bfloat16)
    assert params2["fc"].dtype == jnp.bfloat16
    save_drafter(tmp_path / "bf16b", cfg2, params2, vocab2)
    assert ((tmp_path / "bf16" / "model.safetensors").read_bytes()
            == (tmp_path / "bf16b" / "model.safetensors").read_bytes())


def _expected_keys(fmt, s, bias=False):
    """EAGLE.md section 5, written out independently of the converter."""
    L = "layers.0" if fmt == "speculators" else "midlayer"
    a, h, f, ht = len(s.aux_ids), s.hidden, s.intermediate, s.target_hidden
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    keys = {
        "fc.weight": ((h, a * ht), "F32"),
        f"{L}.self_attn.q_proj.weight": ((q, 2 * h), "F32"),
        f"{L}.self_attn.k_proj.weight": ((kv, 2 * h), "F32"),
        f"{L}.self_attn.v_proj.weight": ((kv, 2 * h), "F32"),
        f"{L}.self_attn.o_proj.weight": ((h, q), "F32"),
        f"{L}.mlp.gate_proj.weight": ((f, h), "F32"),
        f"{L}.mlp.up_proj.weight": ((f, h), "F32"),
        f"{L}.mlp.down_proj.weight": ((h, f), "F32"),
        f"{L}.input_layernorm.weight": ((h,), "F32"),
        f"{L}.hidden_norm.weight": ((h,), "F32"),
        f"{L}.post_attention_layernorm.weight": ((h,), "F32"),
        "norm.weight": ((h,), "F32"),
        "lm_head.weight": ((s.draft_vocab, h), "F32"),
    }
    if fmt == "native" or s.draft_target_ids is not None:  # speculators omits an identity map
        keys["d2t"] = ((s.draft_vocab,), "I64")
        keys["t2d"] = ((s.vocab,), "BOOL")
    if s.fc_norm:
        keys.update({f"fc_norm.{i}.weight": ((ht,), "F32") for i in range(a)})
    if s.norm_before_fc:
        keys["input_norm.weight"] = ((a * ht,), "F32")
    if s.has_embedding:
        keys["embed_tokens.weight"] = ((s.vocab, h), "F32")
    return keys


_NP_CODES = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(np.bool_): "BOOL"}


@pytest.mark.parametrize("fmt", ["speculators", "native"])
@pytest.mark.parametrize("variant", ["eagle31", "target_hidden", "small_vocab", "norm_before_fc"])
def test_exported_files_match_the_format(tmp_path, variant, fmt):
    ref, save_kw, target_cfg, *_ = _build(variant, seed=1)
    ref.save_native(tmp_path / "src", **save_kw)
    cfg, params, vocab = load_drafter(tmp_path / "src", target_cfg)
    save_drafter(tmp_path / "out", cfg, params, vocab, format=fmt)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    expected = _expected_keys(fmt, ref.s)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="numpy") as f:
        got = {k: (tuple(f.get_tensor(k).shape), _NP_CODES[f.get_tensor(k).dtype]) for k in f.keys()}
        assert got == expected
        # the exported [out, in] weights are the reference's own tensors
        src = safetensors_torch.load_file(str(tmp_path / "src" / "model.safetensors"))
        L = "layers.0" if fmt == "speculators" else "midlayer"
        for k in ("fc.weight", "midlayer.self_attn.k_proj.weight", "midlayer.mlp.up_proj.weight",
                  "lm_head.weight"):
            np.testing.assert_array_equal(f.get_tensor(k.replace("midlayer", L)), src[k].numpy())
        if "d2t" in expected:
            np.testing.assert_array_equal(f.get_tensor("d2t"), ref.d2t.numpy())
            np.testing.assert_array_equal(f.get_tensor("t2d"), ref.t2d.numpy())
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    s = ref.s
    if fmt == "speculators":
        assert c["speculators_model_type"] == "eagle3"
        assert isinstance(c["speculators_version"], str) and c["speculators_version"]
        tl = c["transformer_layer_config"]
        assert tl["vocab_size"] == s.vocab and tl["num_hidden_layers"] == 1
        assert tl["hidden_size"] == s.hidden and tl["model_type"] == "llama"
        sc = c["speculators_config"]
        assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
        assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
        assert sc["verifier"] == {"name_or_path": "test/target", "architectures": ["LlamaForCausalLM"]}
        rope_holder = tl
    else:
        assert c["architectures"] == ["LlamaForCausalLM"] and c["num_hidden_layers"] == 1
        assert c["vocab_size"] == s.vocab and c["hidden_size"] == s.hidden
        rope_holder = c
    assert rope_holder["rope_theta"] == s.rope_theta  # inherited values are written out explicitly
    assert rope_holder["max_position_embeddings"] == 4096
    assert c["draft_vocab_size"] == s.draft_vocab and c["target_hidden_size"] == s.target_hidden
    assert c["eagle_aux_hidden_state_layer_ids"] == list(s.aux_ids)
    for flag in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual"):
        assert c[flag] is getattr(s, flag), flag


def test_save_is_atomic(tmp_path, monkeypatch):
    ref, save_kw, target_cfg, *_ = _build("eagle31")
    ref.save_native(tmp_path / "src", **save_kw)
    cfg, params, vocab = load_drafter(tmp_path / "src", target_cfg)
    parent = tmp_path / "exports"
    parent.mkdir()
    import eagle_jax.convert.drafter_formats as df

    real = df.save_safetensors

    def broken(path, tensors, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(df, "save_safetensors", broken)
    with pytest.raises(OSError, match="disk full"):
        save_drafter(parent / "d", cfg, params, vocab)
    assert list(parent.iterdir()) == []
    monkeypatch.setattr(df, "save_safetensors", real)
    save_drafter(parent / "d", cfg, params, vocab)
    with pytest.raises(FileExistsError):
        save_drafter(parent / "d", cfg, params, vocab)
    save_drafter(parent / "d", cfg, params, vocab, format="native", overwrite=True)
    assert [p.name for p in parent.iterdir()] == ["d"]
    assert "speculators_model_type" not in json.loads((parent / "d" / "config.json").read_text())


# ----------------------------------------------------------------------------- malformed

@pytest.fixture(scope="module")
def good_native(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    ref, save_kw, target_cfg, *_ = _build("small_vocab", seed=9)
    ref.save_native(d / "ckpt", **save_kw)
    ref.save_speculators(d / "spec")
    return d, target_cfg


def _mutated(good, tmp_path, weights=None, config=None, src="ckpt"):
    d, target_cfg = good
    out = tmp_path / "bad"
    out.mkdir()
    state = safetensors_torch.load_file(str(d / src / "model.safetensors"))
    cfg = json.loads((d / src / "config.json").read_text())
    if weights:
        weights(state)
    if config:
        config(cfg)
    safetensors_torch.save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out, target_cfg


def _set(d, **kv):
    d.update(kv)


MALFORMED = {
    "missing key": (dict(weights=lambda s: s.pop("midlayer.mlp.up_proj.weight")),
                    "midlayer.mlp.up_proj.weight"),
    "extra key": (dict(weights=lambda s: s.update({"midlayer.extra.weight": torch.zeros(3)})),
                  "midlayer.extra.weight"),
    "wrong shape": (dict(weights=lambda s: s.update(
        {"midlayer.self_attn.k_proj.weight": torch.zeros(32, 64)})), "midlayer.self_attn.k_proj.weight"),
    "wrong d2t length": (dict(weights=lambda s: s.update({"d2t": s["d2t"][:-1].clone()})), "d2t"),
    "d2t out of range": (dict(weights=lambda s: s["d2t"].__setitem__(-1, 10_000)), "d2t"),
    "d2t duplicates": (dict(weights=lambda s: s["d2t"].__setitem__(1, s["d2t"][0] - 1)), "d2t"),
    "t2d inconsistent": (dict(weights=lambda s: s["t2d"].__setitem__(
        int(torch.nonzero(~s["t2d"])[0]), True)), "t2d"),
    "d2t missing with a small draft vocab": (dict(weights=lambda s: s.pop("d2t")), "d2t"),
    "fc_norm weights without the flag": (dict(weights=lambda s: s.update(
        {"fc_norm.0.weight": torch.ones(64)})), "fc_norm.0.weight"),
    "fc_norm + norm_before_fc": (dict(config=lambda c: _set(c, fc_norm=True, norm_before_fc=True)),
                                 "norm_before_fc"),
    "num_hidden_layers 2": (dict(config=lambda c: _set(c, num_hidden_layers=2)), "num_hidden_layers"),
    "misspelled flag": (dict(config=lambda c: _set(c, norm_ouput=True)), "norm_ouput"),
    "near-miss flag": (dict(config=lambda c: _set(c, nrom_output=True)), "nrom_output"),
    "unknown eagle_config key": (dict(config=lambda c: _set(c, eagle_config={"eagle_aux_ids": [1]})),
                                 "eagle_aux_ids"),
    "flag not a bool": (dict(config=lambda c: _set(c, norm_output="yes")), "norm_output"),
    "aux count vs num_aux_hidden_states": (dict(config=lambda c: _set(c, num_aux_hidden_states=4)),
                                           "num_aux_hidden_states"),
    "wrong target_hidden_size": (dict(config=lambda c: _set(c, target_hidden_size=32)),
                                 "target_hidden_size"),
    "aux ids beyond the target": (dict(config=lambda c: _set(
        c, eagle_aux_hidden_state_layer_ids=[2, 4, 9])), "eagle_aux_hidden_state_layer_ids"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoint_names_the_key(good_native, tmp_path, case):
    mutation, key = MALFORMED[case]
    path, target_cfg = _mutated(good_native, tmp_path, **mutation)
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_drafter(path, target_cfg)


@pytest.mark.parametrize("case,mutation,key", [
    ("unknown speculators_model_type", lambda c: _set(c, speculators_model_type="eagle9"),
     "speculators_model_type"),
    ("conflicting flags", lambda c: _set(c, fc_norm=True, norm_before_fc=True), "fc_norm"),
    ("flag disagrees with transformer_layer_config",
     lambda c: c["transformer_layer_config"].update(norm_output=True), "norm_output"),
    ("qwen3 layer", lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "qwen3"),
])
def test_malformed_speculators_config(good_native, tmp_path, case, mutation, key):
    path, target_cfg = _mutated(good_native, tmp_path, config=mutation, src="spec")
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_drafter(path, target_cfg)


def test_layer_key_error_is_a_checkpoint_error(good_native, tmp_path):
    path, target_cfg = _mutated(good_native, tmp_path, weights=lambda s: s.pop("norm.weight"))
    with pytest.raises(CheckpointError, match=re.escape("norm.weight")):
        load_drafter(path, target_cfg)


def test_no_weights_file(tmp_path, good_native):
    d, target_cfg = good_native
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text((d / "ckpt" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_drafter(tmp_path / "c", target_cfg)


def test_sharded_safetensors(tmp_path, good_native):
    d, target_cfg = good_native
    state = safetensors_torch.load_file(str(d / "ckpt" / "model.safetensors"))
    keys = sorted(state)
    out = tmp_path / "sharded"
    out.mkdir()
    shards = {"a.safetensors": keys[:5], "b.safetensors": keys[5:]}
    for name, ks in shards.items():
        safetensors_torch.save_file({k: state[k] for k in ks}, str(out / name))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: n for n, ks in shards.items() for k in ks}}))
    (out / "config.json").write_text((d / "ckpt" / "config.json").read_text())
    _, params_a, _ = load_drafter(out, target_cfg)
    _, params_b, _ = load_drafter(d / "ckpt", target_cfg)
    _assert_trees_equal(params_a, params_b)


# ----------------------------------------------------------------------------- config dialects

def _native_dict(**extra):
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 1, "vocab_size": 300, "draft_vocab_size": 120, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 2048}
    d.update(extra)
    return d


def _tcfg(**kw):
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=30, num_heads=4,
                num_kv_heads=2, head_dim=16, max_position_embeddings=8192,
                rope=RopeConfig(theta=123456.0, scaling_type="llama3", factor=8.0,
                                original_max_position_embeddings=1024))
    base.update(kw)
    return TargetConfig(**base)


def test_specforge_sglang_aux_ids_are_converted():
    sf = _native_dict(architectures=["LlamaForCausalLMEagle3"],
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 26],
                                    "use_aux_hidden_state": True})
    tc = _tcfg()
    assert tc.default_aux_layers() == (2, 15, 27)
    # explicit marker, top level or inside eagle_config
    assert drafter_config_from_dict({**sf, "eagle_aux_layer_semantics": "sglang"}, tc).aux_layer_ids == (2, 15, 27)
    nested = {**sf, "eagle_config": {**sf["eagle_config"], "eagle_aux_layer_semantics": "sglang"}}
    assert drafter_config_from_dict(nested, tc).aux_layer_ids == (2, 15, 27)
    # SpecForge architecture + ids in eagle_config: SGLang convention by default
    assert drafter_config_from_dict(sf, tc).aux_layer_ids == (2, 15, 27)
    # explicit vLLM marker or caller override wins
    assert drafter_config_from_dict({**sf, "eagle_aux_layer_semantics": "vllm"}, tc).aux_layer_ids == (1, 14, 26)
    assert drafter_config_from_dict(sf, tc, aux_layer_semantics="vllm").aux_layer_ids == (1, 14, 26)
    # native / top-level ids are vLLM convention, unsorted lists are sorted
    native = _native_dict(eagle_aux_hidden_state_layer_ids=[27, 2, 15])
    assert drafter_config_from_dict(native, tc).aux_layer_ids == (2, 15, 27)
    native_nested = _native_dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 15, 27]})
    assert drafter_config_from_dict(native_nested, tc).aux_layer_ids == (2, 15, 27)
    with pytest.raises(ConfigError, match="eagle_aux_layer_semantics"):
        drafter_config_from_dict({**sf, "eagle_aux_layer_semantics": "sideways"}, tc)
    # legacy SpecForge alias of fc_norm; nebius alias of draft_vocab_size
    assert drafter_config_from_dict(_native_dict(use_aux_norm=True, norm_output=True), tc).is_eagle31
    trunc = _native_dict(truncated_vocab_size=120)
    del trunc["draft_vocab_size"]
    assert drafter_config_from_dict(trunc, tc).draft_vocab_size == 120


def test_is_drafter_config():
    from eagle_jax.convert.drafter_config import is_drafter_config

    assert is_drafter_config(_native_dict())
    assert is_drafter_config({"speculators_model_type": "eagle3"})
    assert is_drafter_config({"architectures": ["LlamaForCausalLMEagle3"]})
    target = {k: v for k, v in _native_dict().items() if k != "draft_vocab_size"}
    assert not is_drafter_config({**target, "num_hidden_layers": 30})
    assert not is_drafter_config(target)  # a one-layer Llama without drafter keys


def test_specforge_checkpoint_loads_with_sglang_ids(tmp_path):
    ref, _, target_cfg, aux, tokens, embed = _build("eagle31", seed=4)
    ref.save_native(tmp_path / "sf", with_rope=False, architecture="LlamaForCausalLMEagle3",
                    with_aux_ids=False,
                    overrides={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}})
    cfg, params, vocab = load_drafter(tmp_path / "sf", target_cfg)
    assert cfg.aux_layer_ids == (2, 4, 5)
    _assert_chain_matches(cfg, params, vocab, ref, aux, tokens, embed)


def test_config_defaults():
    tc = _tcfg()
    c = drafter_config_from_dict(_native_dict(), tc)
    assert c.rope == RopeConfig()  # no rope_theta / rope_scaling: 10000, unscaled (not the target's)
    assert c.max_position_embeddings == 8192
    assert c.target_hidden_size == 64 and c.head_dim == 16
    assert c.aux_layer_ids == (2, 15, 27)
    assert c.norm_before_residual is False and not c.fc_norm and not c.norm_output
    assert c.verifier_name_or_path == tc.name_or_path and c.rms_norm_eps == 1e-5
    c = drafter_config_from_dict(_native_dict(rope_theta=500000.0), tc)
    assert c.rope == RopeConfig(theta=500000.0)  # no rope_scaling: none, not the target's
    c = drafter_config_from_dict(_native_dict(rope_theta=500000.0, rope_scaling=None), tc)
    assert c.rope == RopeConfig(theta=500000.0)
    c = drafter_config_from_dict(_native_dict(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1000.0}), tc)
    assert c.rope == RopeConfig(theta=1000.0, scaling_type="linear", factor=2.0)
    c = drafter_config_from_dict(_native_dict(max_position_embeddings=100_000), tc)
    assert c.max_position_embeddings == 100_000
    # speculators: norm_before_residual defaults to True (vLLM)
    spec = drafter_config_to_speculators(drafter_config_from_dict(_native_dict(), tc))
    del spec["norm_before_residual"]
    assert drafter_config_from_dict(spec).norm_before_residual is True
    # a transformers-4 to_diff_dict layer config omits values equal to LlamaConfig's defaults
    spec_min = drafter_config_to_speculators(drafter_config_from_dict(
        _native_dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=11008), _tcfg(hidden_size=4096, head_dim=128)))
    for k in ("hidden_size", "num_attention_heads", "intermediate_size", "head_dim"):
        del spec_min["transformer_layer_config"][k]
    c = drafter_config_from_dict(spec_min)
    assert (c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size) == (4096, 32, 128, 11008)
    # no ids and no target: the target's default, resolved when paired
    c = drafter_config_from_dict(_native_dict())
    assert (c.aux_layer_ids, c.num_aux) == ((), 3)
    assert c.for_target(tc).aux_layer_ids == (2, 15, 27)
    with pytest.raises(ConfigError, match="vocab_size"):
        drafter_config_from_dict(_native_dict(), _tcfg(vocab_size=301))
    with pytest.raises(ConfigError, match="target_hidden_size"):
        drafter_config_from_dict(_native_dict(), _tcfg(hidden_size=32, head_dim=8))


def test_config_export_round_trips():
    tc = _tcfg()
    c = drafter_config_from_dict(_native_dict(fc_norm=True, norm_output=True, target_hidden_size=64,
                                              attention_bias=True), tc)
    for to_dict in (drafter_config_to_native, drafter_config_to_speculators):
        d = json.loads(json.dumps(to_dict(c)))
        assert drafter_config_from_dict(d, tc) == c
        assert drafter_config_from_dict(d).replace(verifier_name_or_path=c.verifier_name_or_path,
                                                   verifier_architecture=c.verifier_architecture) == c


# ----------------------------------------------------------------------------- speculators package

@pytest.mark.parametrize("variant", ["eagle3", "eagle31", "norm_before_fc", "norm_before_residual",
                                     "small_vocab"])
def test_speculators_package_agrees(tmp_path, variant, speculators_models):
    """vllm-project/speculators' own Eagle3 model loads our speculators export
    (its pydantic config + strict key check) and its TTT forward (2 steps)
    matches the torch reference; its step 0 matches the JAX drafter.
    scripts/setup.sh installs it (`pip install --no-deps speculators==0.9.0`: it pins
    an older transformers, so it is not a project dependency); under CI (`CI` set) a
    missing or broken install fails, elsewhere it skips."""
    Eagle3DraftModel, Eagle3SpeculatorConfig = (speculators_models.Eagle3DraftModel,
                                                 speculators_models.Eagle3SpeculatorConfig)
    ref, save_kw, target_cfg, aux, tokens, embed = _build(variant, seed=11)
    ref.save_native(tmp_path / "src", **save_kw)
    cfg, params, vocab = load_drafter(tmp_path / "src", target_cfg)
    save_drafter(tmp_path / "out", cfg, params, vocab, format="speculators")

    conf = Eagle3SpeculatorConfig.from_pretrained(str(tmp_path / "out"))
    assert (conf.fc_norm, conf.norm_before_fc, conf.norm_output, conf.norm_before_residual) == (
        cfg.fc_norm, cfg.norm_before_fc, cfg.norm_output, cfg.norm_before_residual)
    assert conf.draft_vocab_size == cfg.draft_vocab_size
    assert list(conf.eagle_aux_hidden_state_layer_ids) == list(cfg.aux_layer_ids)
    conf.transformer_layer_config._attn_implementation = "eager"  # no flex attention on CPU
    model = Eagle3DraftModel(conf).eval()
    state = safetensors_torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == []
    assert set(missing) <= {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    caught = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: caught.append(o.detach().clone()))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(ref.embed_tokens.weight if embed is None else embed)
        model(hidden_states=aux[None], input_ids=tokens[None],
              document_ids=torch.zeros(1, T, dtype=torch.long),
              position_ids=torch.arange(T)[None], ttt_steps=2)
    hook.remove()
    theirs = [c[0].numpy() for c in caught]
    ours = [lg.numpy() for lg in ref_mod.run_ttt(ref, aux, tokens, embed, steps=2)]
    assert len(theirs) == 2
    for i in range(2):
        assert rel(theirs[i], ours[i]) < 1e-5, f"TTT step {i}"
    jax_step0 = jax_chain(cfg, params, vocab, aux, tokens, embed, [0])[0][0]
    assert rel(jax_step0, theirs[0]) < 1e-5


def test_speculators_package_agrees_on_sliding_window(tmp_path, speculators_models):
    """speculators' own model, built from our export of a sliding-window drafter
    (`layer_types: ["sliding_attention"]`), computes the JAX drafter's step 0 over
    more positions than the window."""
    from eagle_jax.config import DrafterConfig
    from eagle_jax.models.drafter import DraftVocab, init_params

    Eagle3DraftModel, Eagle3SpeculatorConfig = (speculators_models.Eagle3DraftModel,
                                                 speculators_models.Eagle3SpeculatorConfig)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
                        vocab_size=60, draft_vocab_size=60, target_hidden_size=32,
                        aux_layer_ids=(1, 2, 3), rope=RopeConfig(theta=10000.0), sliding_window=3)
    params = init_params(cfg, jax.random.PRNGKey(3), scale=0.3)
    save_drafter(tmp_path / "out", cfg, params, DraftVocab.identity(60), format="speculators")
    conf = Eagle3SpeculatorConfig.from_pretrained(str(tmp_path / "out"))
    conf.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel(conf).eval()
    assert model.sliding_window == 3 and model.sliding_window_indices == [0]
    state = safetensors_torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    model.load_state_dict(state, strict=False)
    n = 9
    g = torch.Generator().manual_seed(5)
    aux = torch.randn(n, 3 * 32, generator=g)
    tokens = torch.randint(0, 60, (n,), generator=g)
    embed = torch.randn(60, 32, generator=g)
    caught = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: caught.append(o.detach().clone()))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model(hidden_states=aux[None], input_ids=tokens[None],
              document_ids=torch.zeros(1, n, dtype=torch.long),
              position_ids=torch.arange(n)[None], ttt_steps=1)
    hook.remove()
    ours = jax_chain(cfg, params, DraftVocab.identity(60), aux, tokens, embed, [0])[0][0]
    assert rel(ours, caught[0][0].numpy()) < 1e-5
