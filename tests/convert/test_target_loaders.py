"""Target loaders: GGUF (SmolLM2), HF safetensors (tiny Llama/Qwen2/Qwen3), the
conversion cache, the tokenizer wrapper and the loaders' error messages.

The references are independent: transformers' own GGUF loader and PyTorch
models built and saved by transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.cache import KVCache
from eagle_jax.config import ConfigError, RopeConfig
from eagle_jax.convert import (
    CheckpointError,
    ModelNotFoundError,
    load_converted,
    load_gguf,
    load_hf_directory,
    load_target,
    save_converted,
    target_config_from_hf,
)
from eagle_jax.convert.hf import rope_config_from_hf
from eagle_jax.convert.safetensors_io import SafetensorsFile, save_safetensors
from eagle_jax.models import target

torch = pytest.importorskip("torch")

# A ShareGPT-style request (long enough for a >200-token chat-templated prompt).
PROMPT = (
    "I'm planning a two-week trip to Japan next spring with my partner, and we're trying to "
    "figure out a realistic itinerary. We land in Tokyo in early April, hopefully in time for "
    "the cherry blossoms, and we fly home from Osaka. We both love food, old temples and long "
    "walks, but we're not big on nightclubs or shopping malls. My partner gets tired if we "
    "change hotels too often, so we'd like to stay in at most four different places. We have "
    "a budget of roughly three hundred dollars a day for the two of us, not counting flights. "
    "Could you suggest how many nights we should spend in Tokyo, Kyoto and maybe somewhere "
    "smaller like Kanazawa or Takayama, explain whether the Japan Rail Pass is still worth "
    "buying after the recent price increase, and list a few day trips that are easy to do by "
    "train? Also, what are some etiquette mistakes that first-time visitors often make in "
    "restaurants and on public transport, and how much cash should we carry given that some "
    "small shops still don't take cards? Finally, if it rains for several days in a row, what "
    "indoor activities would you recommend in each city?"
)

TOKENIZER_STRINGS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "Numbers 1234567 and symbols: #@$%^&*() — em-dash, ünïcödé, 日本語のテキスト.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
]


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def full_logits(jit_forward, params, cfg, ids: np.ndarray, max_len: int) -> np.ndarray:
    b, t = ids.shape
    cache = KVCache.create(cfg.num_layers, b, max_len, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, _, _ = jit_forward(params, cfg, jnp.asarray(ids, jnp.int32), pos, cache)
    return np.asarray(target.Target(cfg, params).logits(hidden))


def leaves_with_paths(params):
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_leaves_with_path(params)}


# ----------------------------------------------------------------------------- SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2_prompt_ids(smollm2_target):
    ids = smollm2_target.tokenizer.apply_chat([{"role": "user", "content": PROMPT}])
    assert len(ids) >= 200, len(ids)
    return np.asarray([ids], np.int32)


@pytest.fixture(scope="module")
def smollm2_our_logits(smollm2_target, smollm2_prompt_ids, jit_forward):
    t = smollm2_prompt_ids.shape[1]
    return full_logits(jit_forward, smollm2_target.params, smollm2_target.cfg, smollm2_prompt_ids,
                       max_len=t + 16)


def test_smollm2_config(smollm2_target):
    cfg = smollm2_target.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.rope == RopeConfig(theta=100000.0)
    assert cfg.tie_word_embeddings and "lm_head" not in smollm2_target.params
    assert cfg.max_position_embeddings == 8192 and cfg.architecture == "LlamaForCausalLM"
    assert cfg.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    im_end = smollm2_target.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in cfg.eos_token_ids and im_end in smollm2_target.tokenizer.eos_token_ids


def test_smollm2_weights_equal_transformers(smollm2_target, smollm2_hf_model):
    """Dequantised, un-permuted, transposed and fused weights equal transformers' exactly."""
    cfg, p = smollm2_target.cfg, smollm2_target.params
    sd = {k: v.numpy() for k, v in smollm2_hf_model.state_dict().items()}
    Q, KV, F = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    np.testing.assert_array_equal(np.asarray(p["embed"]), sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(p["final_norm"]), sd["model.norm.weight"])
    lay = {k: np.asarray(v) for k, v in p["layers"].items()}
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        w = lay["wqkv"][i]
        np.testing.assert_array_equal(w[:, :Q], sd[pre + "self_attn.q_proj.weight"].T)
        np.testing.assert_array_equal(w[:, Q:Q + KV], sd[pre + "self_attn.k_proj.weight"].T)
        np.testing.assert_array_equal(w[:, Q + KV:], sd[pre + "self_attn.v_proj.weight"].T)
        np.testing.assert_array_equal(lay["wo"][i], sd[pre + "self_attn.o_proj.weight"].T)
        np.testing.assert_array_equal(lay["w_gate_up"][i][:, :F], sd[pre + "mlp.gate_proj.weight"].T)
        np.testing.assert_array_equal(lay["w_gate_up"][i][:, F:], sd[pre + "mlp.up_proj.weight"].T)
        np.testing.assert_array_equal(lay["w_down"][i], sd[pre + "mlp.down_proj.weight"].T)
        np.testing.assert_array_equal(lay["attn_norm"][i], sd[pre + "input_layernorm.weight"])
        np.testing.assert_array_equal(lay["mlp_norm"][i], sd[pre + "post_attention_layernorm.weight"])


def test_smollm2_logits_match_transformers(smollm2_prompt_ids, smollm2_our_logits, smollm2_hf_model):
    with torch.no_grad():
        ref = smollm2_hf_model(torch.from_numpy(smollm2_prompt_ids.astype(np.int64))).logits.numpy()
    err = rel_err(smollm2_our_logits, ref)
    assert err < 1e-4, err
    agree = (smollm2_our_logits.argmax(-1) == ref.argmax(-1)).mean()
    assert agree > 0.99, agree


def test_smollm2_prefill_then_decode_matches_full_forward(smollm2_target, smollm2_prompt_ids,
                                                         smollm2_our_logits, jit_forward):
    cfg, params = smollm2_target.cfg, smollm2_target.params
    t = smollm2_prompt_ids.shape[1]
    p = t - 8
    ids = jnp.asarray(smollm2_prompt_ids)
    cache = KVCache.create(cfg.num_layers, 1, t + 16, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    hidden, cache, _ = jit_forward(params, cfg, ids[:, :p], jnp.arange(p, dtype=jnp.int32)[None], cache)
    cache = cache.commit(jnp.asarray([p]))
    pieces = [np.asarray(target.Target(cfg, params).logits(hidden))]
    for i in range(p, t):
        hidden, cache, _ = jit_forward(params, cfg, ids[:, i:i + 1], jnp.asarray([[i]], jnp.int32), cache)
        cache = cache.commit(jnp.asarray([1]))
        pieces.append(np.asarray(target.Target(cfg, params).logits(hidden)))
    stepwise = np.concatenate(pieces, axis=1)
    assert int(cache.lengths[0]) == t
    assert rel_err(stepwise[:, :p], smollm2_our_logits[:, :p]) < 1e-4
    err = rel_err(stepwise[:, p:], smollm2_our_logits[:, p:])
    assert err < 1e-4, err


def test_smollm2_tokenizer_matches_transformers(smollm2_target, smollm2_hf_tokenizer):
    ours, ref = smollm2_target.tokenizer, smollm2_hf_tokenizer
    for s in TOKENIZER_STRINGS:
        assert ours.encode(s) == ref.encode(s), s
        assert ours.decode(ours.encode(s)) == ref.decode(ref.encode(s))
    conversations = [
        "What is the capital of France?",
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": PROMPT[:300]}],
    ]
    for conv in conversations:
        msgs = [{"role": "user", "content": conv}] if isinstance(conv, str) else conv
        want = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert ours.apply_chat(conv) == want
        text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
        assert ours.render_chat(msgs, add_generation_prompt=False) == text
    assert ours.pad_id == 2 and ours.vocab_size == 49152


def test_converted_cache_second_load_is_bit_identical(smollm2_gguf, smollm2_hf_tokenizer, tmp_path):
    t0 = time.perf_counter()
    first = load_target(smollm2_gguf, cache_dir=str(tmp_path))
    t1 = time.perf_counter()
    second = load_target(smollm2_gguf, cache_dir=str(tmp_path))
    t2 = time.perf_counter()
    print(f"SmolLM2 first load (convert + cache) {t1 - t0:.1f}s, cached load {t2 - t1:.2f}s")

    entries = os.listdir(tmp_path / "targets")
    assert len(entries) == 1 and not entries[0].startswith("."), entries  # no temp leftovers
    a, b = leaves_with_paths(first.params), leaves_with_paths(second.params)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == np.float32, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert first.cfg == second.cfg and first.source == second.source == smollm2_gguf
    # the GGUF tokenizer (first) and the one saved in the cache (second) agree with transformers
    for s in TOKENIZER_STRINGS:
        assert first.tokenizer.encode(s) == second.tokenizer.encode(s) == smollm2_hf_tokenizer.encode(s)
        ids = smollm2_hf_tokenizer.encode(s)
        assert second.tokenizer.decode(ids) == smollm2_hf_tokenizer.decode(ids)
    # the cached copy is read by the generic fast class (no AutoTokenizer imports)
    assert type(second.tokenizer.hf).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": PROMPT[:200]}]
    for c in (PROMPT, conv):
        assert first.tokenizer.apply_chat(c) == second.tokenizer.apply_chat(c)
        assert first.tokenizer.render_chat(c, False) == second.tokenizer.render_chat(c, False)
    for attr in ("eos_token_ids", "pad_id", "bos_id", "vocab_size"):
        assert getattr(first.tokenizer, attr) == getattr(second.tokenizer, attr), attr
    assert t2 - t1 < t1 - t0
    # the cache entry is itself a loadable converted directory
    entry = load_target(str(tmp_path / "targets" / entries[0]))
    np.testing.assert_array_equal(np.asarray(entry.params["embed"]), a["['embed']"])


# ----------------------------------------------------------------------------- tiny HF models


TINY = ["llama3", "llama_bf16", "qwen2", "qwen2_sharded", "qwen3", "qwen3_bias_yarn"]


@pytest.mark.parametrize("layers", ["stacked", "unrolled"])
@pytest.mark.parametrize("name", TINY)
def test_tiny_hf_logits_match_transformers(tiny_hf, jit_forward, name, layers):
    path, ref_model = tiny_hf(name)
    cfg, params = load_hf_directory(path, "float32")
    hf_cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg.architecture == hf_cfg["architectures"][0]
    assert cfg.qk_norm == (cfg.architecture == "Qwen3ForCausalLM")
    assert ("bqkv" in params["layers"]) == cfg.qkv_bias
    assert ("lm_head" in params) == (not cfg.tie_word_embeddings)
    if name == "qwen2_sharded":
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
        assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
    ids = np.random.RandomState(1).randint(0, cfg.vocab_size, size=(2, 40)).astype(np.int32)
    with torch.no_grad():
        ref = ref_model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    if layers == "unrolled":
        params = target.unstack_layers(params)
        assert sorted(params["layers"]) == list(range(cfg.num_layers))
    ours = full_logits(jit_forward, params, cfg, ids, max_len=48)
    err = rel_err(ours, ref)
    assert err < 1e-4, err


def test_unrolled_layers_equal_scan_with_aux_and_cache(tiny_hf, jit_forward):
    """Both layer drivers give the same hidden states, aux features and cache."""
    cfg, params = load_hf_directory(tiny_hf("qwen3_bias_yarn")[0], "float32")
    ids = jnp.asarray(np.random.RandomState(2).randint(0, cfg.vocab_size, (2, 9)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    aux = (0, cfg.num_layers // 2, cfg.num_layers - 1)
    outs = []
    for p in (params, target.unstack_layers(params)):
        cache = KVCache.create(cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
        cache = cache.replace(lengths=jnp.array([0, 3], jnp.int32))
        outs.append(jit_forward(p, cfg, ids, pos, cache, aux_layers=aux))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert outs[0][2].shape == (2, 9, 3 * cfg.hidden_size)


def test_tiny_hf_config_fields(tiny_hf):
    cfg, _ = load_hf_directory(tiny_hf("llama3")[0])
    assert cfg.rope == RopeConfig(theta=10000.0, scaling_type="llama3", factor=8.0,
                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=16)
    assert cfg.qkv_bias and cfg.o_bias and cfg.eos_token_ids == (2,)
    cfg, params = load_hf_directory(tiny_hf("qwen3")[0])
    assert cfg.head_dim == 32 and cfg.q_size == 128 and params["layers"]["q_norm"].shape == (3, 32)
    assert not cfg.qkv_bias and not cfg.o_bias
    cfg, _ = load_hf_directory(tiny_hf("qwen3_bias_yarn")[0])
    assert cfg.qkv_bias and cfg.o_bias and cfg.rope.scaling_type == "yarn"
    cfg, _ = load_hf_directory(tiny_hf("qwen2")[0])
    assert cfg.qkv_bias and not cfg.o_bias and cfg.tie_word_embeddings


def test_bf16_checkpoint_loads_as_bf16_and_fp32(tiny_hf):
    path, _ = tiny_hf("llama_bf16")
    src = SafetensorsFile(os.path.join(path, "model.safetensors"))
    assert src.dtype("model.embed_tokens.weight").name == "bfloat16"
    _, p16 = load_hf_directory(path, "bfloat16")
    _, p32 = load_hf_directory(path, "float32")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p32))
    emb = np.asarray(src["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(p16["embed"]), emb)
    np.testing.assert_array_equal(np.asarray(p32["embed"]), emb.astype(np.float32))
    q = np.asarray(src["model.layers.1.self_attn.q_proj.weight"]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(p32["layers"]["wqkv"][1][:, :q.shape[0]]), q.T)


def test_converted_dir_roundtrip_without_tokenizer(tiny_hf, tmp_path):
    path, _ = tiny_hf("qwen3")
    first = load_target(path, cache_dir=str(tmp_path / "cache"))
    assert first.tokenizer is None
    second = load_target(path, cache_dir=str(tmp_path / "cache"))
    out = save_converted(second, tmp_path / "converted")
    third = load_target(out)
    again = load_converted(out, dtype="bfloat16")
    assert first.cfg == second.cfg == third.cfg
    a, b, c = (leaves_with_paths(t.params) for t in (first, second, third))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        np.testing.assert_array_equal(a[k], c[k])
    assert again.params["embed"].dtype == jnp.bfloat16
    # another dtype is another cache entry
    bf = load_target(path, dtype="bfloat16", cache_dir=str(tmp_path / "cache"))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf.params))
    assert len(os.listdir(tmp_path / "cache" / "targets")) == 2
    # a changed source (new mtime) is converted again instead of served stale
    cfg_file = os.path.join(path, "config.json")
    st = os.stat(cfg_file)
    os.utime(cfg_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        load_target(path, cache_dir=str(tmp_path / "cache"))
        assert len(os.listdir(tmp_path / "cache" / "targets")) == 3
    finally:
        os.utime(cfg_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an eagle-jax converted target"):
        save_converted(second, tmp_path / "other")


# ----------------------------------------------------------------------------- synthetic GGUF


@pytest.mark.parametrize("name,arch", [("llama3_gguf", "llama"), ("qwen3", "qwen3"),
                                       ("qwen2", "qwen2")])
def test_synthetic_gguf_matches_hf_loader(tiny_hf, gguf_writer, jit_forward, tmp_path, name, arch):
    path, ref_model = tiny_hf(name)
    gguf_path = gguf_writer(ref_model, str(tmp_path / f"{name}.gguf"), arch)
    cfg, params, meta = load_gguf(gguf_path)
    hf_cfg, hf_params = load_hf_directory(path)
    assert meta["tokenizer.ggml.eos_token_id"] == 2
    assert cfg.rope == hf_cfg.rope  # llama3 recovered from rope_freqs.weight for llama3_gguf
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "qkv_bias", "o_bias", "qk_norm", "tie_word_embeddings", "architecture"):
        assert getattr(cfg, field) == getattr(hf_cfg, field), field
    a, b = leaves_with_paths(params), leaves_with_paths(hf_params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    ids = np.random.RandomState(2).randint(0, cfg.vocab_size, size=(1, 48)).astype(np.int32)
    with torch.no_grad():
        ref = ref_model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    assert rel_err(full_logits(jit_forward, params, cfg, ids, 64), ref) < 1e-4


def test_gguf_errors(tiny_hf, gguf_writer, tmp_path):
    _, model = tiny_hf("llama3_gguf")
    p = gguf_writer(model, str(tmp_path / "gemma.gguf"), "gemma")
    with pytest.raises(ConfigError, match=r"general\.architecture.*'gemma'"):
        load_gguf(p)
    p = gguf_writer(model, str(tmp_path / "drop.gguf"), "llama", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensor.*blk\.1\.ffn_up\.weight"):
        load_gguf(p)
    p = gguf_writer(model, str(tmp_path / "extra.gguf"), "llama",
                    extra={"blk.0.ffn_extra.weight": np.zeros((4, 64), np.float32)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*blk\.0\.ffn_extra\.weight"):
        load_gguf(p)
    p = gguf_writer(model, str(tmp_path / "shape.gguf"), "llama",
                    extra={"blk.0.ffn_norm.weight": np.ones((32,), np.float32)})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_norm\.weight.*shape \[32\].*expected \[64\]"):
        load_gguf(p)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gguf(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_gguf(tmp_path / "junk.gguf")


# ----------------------------------------------------------------------------- errors


@pytest.fixture
def llama_copy(tiny_hf, tmp_path):
    src, _ = tiny_hf("llama3")
    dst = tmp_path / "llama"
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(directory, edit):
    path = os.path.join(directory, "model.safetensors")
    f = SafetensorsFile(path)
    tensors = {k: np.array(f[k]) for k in f}
    del f
    edit(tensors)
    save_safetensors(path, tensors)


def _rewrite_config(directory, edit):
    path = os.path.join(directory, "config.json")
    config = json.load(open(path))
    edit(config)
    json.dump(config, open(path, "w"))


def test_missing_file_or_directory(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_target(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_target(str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_directory(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_directory(tmp_path / "empty")
    with pytest.raises(ModelNotFoundError, match="neither config.json"):
        load_target(str(tmp_path / "empty"))


def test_missing_weights_file(llama_copy):
    os.remove(llama_copy / "model.safetensors")
    (llama_copy / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no model.safetensors.*pytorch_model.bin"):
        load_hf_directory(llama_copy)


def test_missing_tensor(llama_copy):
    _rewrite_weights(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_directory(llama_copy)


def test_extra_tensor(llama_copy):
    _rewrite_weights(llama_copy, lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    load_hf_directory(llama_copy)  # known harmless buffer: accepted
    _rewrite_weights(llama_copy, lambda t: t.update(
        {"model.layers.0.mlp.extra_proj.weight": np.ones((4, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model\.layers\.0\.mlp\.extra_proj\.weight"):
        load_hf_directory(llama_copy)


def test_wrong_shape(llama_copy):
    _rewrite_weights(llama_copy, lambda t: t.update(
        {"model.layers.2.self_attn.k_proj.weight": np.zeros((16, 64), np.float32)}))
    with pytest.raises(CheckpointError,
                       match=r"model\.layers\.2\.self_attn\.k_proj\.weight.*shape \[16, 64\].*expected \[32, 64\]"):
        load_hf_directory(llama_copy)


def test_tied_lm_head_must_equal_embedding(tiny_hf, tmp_path):
    src, _ = tiny_hf("qwen2")
    d = tmp_path / "qwen2"
    shutil.copytree(src, d)
    _rewrite_weights(d, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    load_hf_directory(d)
    _rewrite_weights(d, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight.*differs.*tie_word_embeddings"):
        load_hf_directory(d)


def test_sharded_index_lists_absent_tensor(tiny_hf, tmp_path):
    src, _ = tiny_hf("qwen2_sharded")
    d = tmp_path / "sharded"
    shutil.copytree(src, d)
    index = json.load(open(d / "model.safetensors.index.json"))
    shard = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.layers.0.mlp.ghost.weight"] = shard
    json.dump(index, open(d / "model.safetensors.index.json", "w"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.ghost\.weight.*absent from shard"):
        load_hf_directory(d)


def test_unsupported_architecture(llama_copy):
    _rewrite_config(llama_copy, lambda c: c.update(architectures=["MistralForCausalLM"],
                                                   model_type="mistral"))
    with pytest.raises(ConfigError, match=r"unsupported architecture.*architectures.*MistralForCausalLM"):
        load_hf_directory(llama_copy)
    with pytest.raises(ConfigError, match=r"model_type.*'gemma'"):
        target_config_from_hf({"model_type": "gemma", "hidden_size": 8})


BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
        "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}


@pytest.mark.parametrize("rope,match", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     r"rope type.*rope_parameters\.rope_type.*'dynamic'"),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
     r"rope type.*rope_scaling\.type.*'longrope'"),
    ({"rope_theta": 1e4, "rope_scaling": {"rope_type": "su", "factor": 2.0}},
     r"rope_scaling\.rope_type.*'su'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "default"}}},
     r"rope_parameters.*per layer type"),
])
def test_unsupported_rope_type(rope, match):
    with pytest.raises(ConfigError, match=match):
        target_config_from_hf({**BASE, **rope})


@pytest.mark.parametrize("update,match", [
    ({"mlp_bias": True}, r"mlp_bias.*True"),
    ({"hidden_act": "gelu"}, r"hidden_act.*'gelu'"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True},
     r"use_sliding_window.*True"),
    ({"sliding_window": 4096}, r"sliding_window.*4096"),
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
      "layer_types": ["sliding_attention"]}, r"layer_types.*sliding_attention"),
    ({"quantization_config": {"quant_method": "gptq"}}, r"quantization_config.*gptq"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor.*0\.5"),
    ({"text_config": {"hidden_size": 8}}, r"text_config"),
    ({"num_attention_heads": 3, "num_key_value_heads": 2}, r"multiple"),
    ({"hidden_size": None}, r"'hidden_size' is missing"),
    ({"num_hidden_layers": "two"}, r"num_hidden_layers.*'two'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     r"low_freq_factor.*missing"),
    ({"model_type": "qwen2"}, r"model_type.*'qwen2'.*contradicts"),
])
def test_unsupported_config_value(update, match):
    with pytest.raises(ConfigError, match=match):
        target_config_from_hf({**BASE, **update})


def test_rope_formats_are_equivalent():
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    new = rope_config_from_hf({**BASE, "rope_parameters": {"rope_type": "llama3",
                                                           "rope_theta": 5e5, **llama3}})
    old = rope_config_from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **llama3}})
    older = rope_config_from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **llama3}})
    assert new == old == older and new.scaling_type == "llama3" and new.theta == 5e5
    assert rope_config_from_hf({**BASE, "rope_theta": 1e6, "rope_scaling": None}) == RopeConfig(1e6)
    assert rope_config_from_hf(BASE) == RopeConfig(10000.0)
    lin = rope_config_from_hf({**BASE, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert lin == RopeConfig(scaling_type="linear", factor=4.0)
    yarn = rope_config_from_hf({**BASE, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}})
    assert (yarn.factor, yarn.original_max_position_embeddings, yarn.beta_fast, yarn.beta_slow,
            yarn.attention_factor) == (4.0, 32768, 32.0, 1.0, None)
    ds = rope_config_from_hf({**BASE, "rope_parameters": {
        "rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096}})
    f = lambda m: 0.1 * m * np.log(40.0) + 1.0  # noqa: E731
    assert ds.attention_factor == pytest.approx(f(1.0) / f(0.707))
    qwen3 = target_config_from_hf({**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    assert qwen3.head_dim == 128  # Qwen3's default, not hidden_size // heads


def test_hub_id_unreachable_names_the_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match=r"'no-such-org/no-such-model'.*hub"):
        load_target("no-such-org/no-such-model")


def test_safetensors_io_interoperates(tmp_path):
    import ml_dtypes
    from safetensors import safe_open
    from safetensors.torch import save_file

    arrays = {"a.b": np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16),
              "c": np.arange(5, dtype=np.int32), "d": np.ones((2, 0), np.float16)}
    save_safetensors(tmp_path / "ours.safetensors", arrays, metadata={"k": "v"})
    with safe_open(tmp_path / "ours.safetensors", framework="flax") as f:
        assert f.metadata() == {"k": "v"}
        for k, v in arrays.items():
            np.testing.assert_array_equal(np.asarray(f.get_tensor(k)), v)
    save_file({"x": torch.randn(3, 5).bfloat16()}, str(tmp_path / "torch.safetensors"))
    ours = SafetensorsFile(tmp_path / "torch.safetensors")
    with safe_open(tmp_path / "torch.safetensors", framework="flax") as f:
        np.testing.assert_array_equal(np.asarray(ours["x"]), np.asarray(f.get_tensor("x")))


def test_atomic_directory_replace_keep_and_failure(tmp_path):
    from eagle_jax.convert.atomic import atomic_directory

    out = tmp_path / "out"
    with atomic_directory(out) as d:
        (d / "f").write_text("one")
    with atomic_directory(out) as d:  # replaces
        (d / "f").write_text("two")
    assert (out / "f").read_text() == "two"
    with atomic_directory(out, keep_existing=True) as d:  # a cache another writer filled first: kept
        (d / "f").write_text("three")
    assert (out / "f").read_text() == "two"
    with pytest.raises(RuntimeError):
        with atomic_directory(out) as d:
            (d / "f").write_text("four")
            raise RuntimeError("writer failed")
    assert (out / "f").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary leftovers
