"""Parallel drafter (P-EAGLE) checkpoints: the speculators `peagle` format vLLM serves, the native
`pard_token` form, both ways, and the one-line errors."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest

from eagle_jax.config import CheckpointError, ConfigError, DrafterConfig, TargetConfig
from eagle_jax.convert.drafter_config import drafter_config_from_dict
from eagle_jax.convert.drafter_formats import load_drafter, load_drafter_tensors, save_drafter
from eagle_jax.convert.safetensors_io import save_safetensors
from eagle_jax.models import drafter

V, VD, MASK = 80, 48, 7
TARGET = TargetConfig(vocab_size=V, hidden_size=24, intermediate_size=40, num_layers=8, num_heads=4,
                      num_kv_heads=2, head_dim=6, max_position_embeddings=256, name_or_path="test/target")


def _drafter(**kw):
    base = dict(hidden_size=24, intermediate_size=40, num_heads=4, num_kv_heads=2, head_dim=6, vocab_size=V,
                draft_vocab_size=VD, target_hidden_size=24, aux_layer_ids=(2, 4, 5), fc_norm=True,
                norm_output=True, mask_token_id=MASK, speculative_tokens=5, max_position_embeddings=256,
                verifier_name_or_path="test/target")
    cfg = DrafterConfig(**{**base, **kw})
    params = drafter.init_params(cfg, jax.random.PRNGKey(0), scale=0.3)
    vocab = drafter.DraftVocab.from_target_ids(np.arange(V - VD, V), V)
    return cfg, params, vocab


@pytest.mark.parametrize("fmt", ["speculators", "native"])
def test_round_trip(tmp_path, fmt):
    cfg, params, vocab = _drafter()
    save_drafter(tmp_path / "d", cfg, params, vocab, format=fmt)
    got_cfg, got_params, got_vocab = load_drafter(tmp_path / "d", TARGET)
    assert got_cfg == (cfg if fmt == "speculators" else cfg.replace(speculative_tokens=3))  # native: no K stored
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got_params, params)
    np.testing.assert_array_equal(np.asarray(got_vocab.d2t), np.asarray(vocab.d2t))
    assert load_drafter_tensors(tmp_path / "d")["mask_hidden"].shape == (1, 1, cfg.fc_in_size)  # speculators'



def test_speculators_config_is_what_vllm_reads(tmp_path):
    """vLLM's speculators path (transformers_utils/configs/speculators): the hf config starts from
    transformer_layer_config, `update_peagle` adds pard_token = mask_token_id (and not fc_norm or
    norm_output), base.py serves method eagle3 + parallel_drafting with
    proposal_methods[0].speculative_tokens tokens."""
    cfg, params, vocab = _drafter()
    save_drafter(tmp_path / "d", cfg, params, vocab)
    c = json.loads((tmp_path / "d" / "config.json").read_text())
    assert c["speculators_model_type"] == "peagle" and c["speculators_config"]["algorithm"] == "peagle"
    assert c["mask_token_id"] == MASK and "pard_token" not in c
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert c["speculators_config"]["verifier"]["name_or_path"] == "test/target"
    layer = c["transformer_layer_config"]
    assert layer["fc_norm"] is True and layer["norm_output"] is True  # seen by vLLM's layer
    assert c["norm_before_residual"] is False
    # the sequential drafter is still written as eagle3, without a placeholder
    plain = cfg.replace(mask_token_id=None)
    save_drafter(tmp_path / "e", plain, {k: v for k, v in params.items() if k != "mask_hidden"}, vocab)
    c = json.loads((tmp_path / "e" / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3" and "mask_token_id" not in c
    assert "fc_norm" not in c["transformer_layer_config"]


def test_native_placeholder_names(tmp_path):
    """A native config names the placeholder pard_token (written), ptd_token_id or mask_token_id."""
    cfg, params, vocab = _drafter()
    save_drafter(tmp_path / "d", cfg, params, vocab, format="native")
    c = json.loads((tmp_path / "d" / "config.json").read_text())
    assert c["pard_token"] == MASK
    for key in ("ptd_token_id", "mask_token_id"):
        d = {k: v for k, v in c.items() if k != "pard_token"} | {key: MASK}
        assert drafter_config_from_dict(d, TARGET).mask_token_id == MASK
    assert drafter_config_from_dict({**c, "ptd_token_id": MASK}, TARGET).mask_token_id == MASK
    plain = {k: v for k, v in c.items() if k != "pard_token"}
    assert drafter_config_from_dict(plain, TARGET).mask_token_id is None


def test_speculators_mask_hidden_shape_is_read(tmp_path):
    """mask_hidden as vLLM's buffer [1, A*Ht] or flat [A*Ht] loads too."""
    cfg, params, vocab = _drafter()
    save_drafter(tmp_path / "d", cfg, params, vocab)
    tensors = _copied(tmp_path / "d")
    for shape in [(1, cfg.fc_in_size), (cfg.fc_in_size,)]:
        save_safetensors(tmp_path / "d" / "model.safetensors",
                         {**tensors, "mask_hidden": tensors["mask_hidden"].reshape(shape)})
        _, got, _ = load_drafter(tmp_path / "d", TARGET)
        np.testing.assert_array_equal(np.asarray(got["mask_hidden"]), np.asarray(params["mask_hidden"]))


def _copied(path) -> dict:
    """The checkpoint's tensors in memory (the loader maps the file, which the tests rewrite)."""
    return {k: np.array(v) for k, v in load_drafter_tensors(path).items()}


def _edit(path, config=None, tensors=None):
    if config is not None:
        c = json.loads((path / "config.json").read_text())
        config(c)
        (path / "config.json").write_text(json.dumps(c))
    if tensors is not None:
        t = _copied(path)
        tensors(t)
        save_safetensors(path / "model.safetensors", t)


BAD = {
    "peagle without mask_token_id": ("speculators", dict(config=lambda c: c.pop("mask_token_id")),
                                     ConfigError, "needs mask_token_id"),
    "placeholder in an eagle3 config": ("speculators", dict(config=lambda c: c.update(
        speculators_model_type="eagle3", speculators_config={**c["speculators_config"], "algorithm": "eagle3"})),
        ConfigError, "speculators eagle3 config"),
    "algorithm not the model type": ("speculators", dict(config=lambda c: c["speculators_config"].update(
        algorithm="eagle3")), ConfigError, "speculators_config.algorithm"),
    "placeholder ids disagree": ("native", dict(config=lambda c: c.update(ptd_token_id=MASK + 1)),
                                 ConfigError, "placeholder token ids disagree"),
    "placeholder outside the vocabulary": ("speculators", dict(config=lambda c: c.update(mask_token_id=V)),
                                           ConfigError, "mask_token_id must be a token id"),
    "placeholder not an integer": ("native", dict(config=lambda c: c.update(pard_token="7")),
                                   ConfigError, "pard_token"),
    "mask_hidden missing": ("speculators", dict(tensors=lambda t: t.pop("mask_hidden")),
                            CheckpointError, "mask_hidden"),
    "mask_hidden of the wrong size": ("speculators", dict(tensors=lambda t: t.update(
        mask_hidden=t["mask_hidden"][..., :-1])), CheckpointError, "mask_hidden has shape"),
    "mask_hidden without a placeholder": ("native", dict(config=lambda c: c.pop("pard_token")),
                                          CheckpointError, "names no placeholder token"),
    "fc_norm disagrees with transformer_layer_config": ("speculators", dict(
        config=lambda c: c["transformer_layer_config"].update(fc_norm=False)), ConfigError, "fc_norm"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_say_why(tmp_path, case):
    fmt, edit, error, message = BAD[case]
    cfg, params, vocab = _drafter()
    save_drafter(tmp_path / "d", cfg, params, vocab, format=fmt)
    _edit(tmp_path / "d", **edit)
    with pytest.raises(error, match=re.escape(message)) as info:
        load_drafter(tmp_path / "d", TARGET)
    assert "\n" not in str(info.value)


def test_speculators_peagle_model_agrees(tmp_path, speculators_models, monkeypatch):
    """vllm-project/speculators' own PEagleDraftModel loads our peagle export (its pydantic
    config, its parameter shapes) and its training forward, over every anchor at every depth
    (COD sampling replaced by the full set), gives the logits of our parallel TTT unroll."""
    import torch

    from eagle_jax.train import ttt

    cfg, params, vocab = _drafter()
    save_drafter(tmp_path / "d", cfg, params, vocab)
    conf = speculators_models.PEagleSpeculatorConfig.from_pretrained(str(tmp_path / "d"))
    assert conf.mask_token_id == MASK and (conf.fc_norm, conf.norm_output) == (True, True)
    conf.transformer_layer_config._attn_implementation = "eager"  # no flex attention on CPU
    model = speculators_models.PEagleDraftModel(conf).eval()
    state = {k: torch.from_numpy(np.array(v)) for k, v in load_drafter_tensors(tmp_path / "d").items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"embed_tokens.weight", "verifier_lm_head.weight",
                                                 "verifier_norm.weight"}
    t, depths = 10, 4
    rng = np.random.default_rng(3)
    aux = rng.standard_normal((t, cfg.fc_in_size)).astype(np.float32)
    ids = rng.integers(0, V, t)
    embed = rng.standard_normal((V, cfg.hidden_size)).astype(np.float32)
    # speculators' batch is shifted: its input_ids[a] is the token after hidden_states[a]
    anchors = [(a, d) for d in range(depths) for a in range(t - 1 - d)]
    import speculators.models.peagle.core as core

    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda **kw: (
        torch.tensor([a for a, _ in anchors]), torch.tensor([d for _, d in anchors])))
    monkeypatch.setattr(core, "compute_metrics", lambda **kw: (torch.zeros(()), {}))  # its loss needs Triton
    caught = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: caught.append(o.detach().clone()))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.from_numpy(embed))
        model(hidden_states=torch.from_numpy(aux[None, :-1]), input_ids=torch.from_numpy(ids[None, 1:]),
              document_ids=torch.zeros(1, t - 1, dtype=torch.long), num_depths=depths,
              verifier_last_hidden_states=torch.zeros(1, t - 1, cfg.hidden_size))
    hook.remove()
    theirs = caught[0][0].numpy()  # [elements, Vd]
    ours = ttt.unroll(params, cfg, embed, aux[None], ids[None].astype(np.int32), np.array([t], np.int32), depths,
                      impl="xla")
    want = np.stack([np.asarray(ours[d][0, a]) for a, d in anchors])
    assert np.linalg.norm(theirs - want) / np.linalg.norm(want) < 1e-5
