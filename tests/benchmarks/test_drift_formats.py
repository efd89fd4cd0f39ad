"""The drift suite's prompt formats (issue 47: acceptance by chat template and system prompt) and
its acceptance length by chain depth."""

import pytest

from eagle_jax.benchmarks.drift import PROMPT_FORMATS, SYSTEM_PROMPTS, format_prompt, summarize

TEXT = "Write a function that reverses a string."


@pytest.fixture(scope="module")
def tok(smollm2_target):
    return smollm2_target.tokenizer


def test_each_format_renders_its_own_system_prompt(tok):
    texts = {f: tok.decode(format_prompt(tok, TEXT, f)) for f in PROMPT_FORMATS}
    default = tok.decode(tok.apply_chat(TEXT))
    assert texts["template"] == default
    assert len(set(texts.values())) == len(PROMPT_FORMATS)  # five different token sequences
    for f, system in SYSTEM_PROMPTS.items():
        assert system in texts[f] and TEXT in texts[f]
        assert texts[f].count("<|im_start|>system") == 1  # replaces the default, not added to it
    assert texts["raw"] == TEXT and "<|im_start|>" not in texts["raw"]
    with pytest.raises(ValueError, match="unknown prompt format 'chatml'"):
        format_prompt(tok, TEXT, "chatml")


def test_tau_by_depth_is_one_plus_the_summed_per_position_acceptance():
    """Records of two prompts: tau at the full depth is the mean tau; a shallower chain accepts the
    same prefix (greedy), so its tau sums fewer positions."""
    base = {"drafter": "d", "label": "d", "variant": "eagle3.1", "random_init": False, "context": "short",
            "prompt_tokens": 10, "hidden_rms_by_depth": [1.0] * 3, "feedback_out_rms_by_depth": [1.0] * 3,
            "sink_mass_by_depth": [0.1] * 3, "feature_rms_prompt": 1.0, "sink_mass_prompt": 0.1,
            "root_accepted": 1}
    recs = [{**base, "format": "raw", "tau": 1 + 0.8 + 0.5 + 0.2, "per_position_acceptance": [0.8, 0.5, 0.2]},
            {**base, "format": "raw", "tau": 1 + 0.6 + 0.3 + 0.0, "per_position_acceptance": [0.6, 0.3, 0.0]},
            {**base, "format": "template", "tau": 2.0, "per_position_acceptance": [1.0, 0.0, 0.0]}]
    out = summarize(recs, 3)
    assert [g["format"] for g in out] == ["template", "raw"]  # PROMPT_FORMATS order
    raw = out[1]
    assert raw["tau_by_depth"] == pytest.approx([1.7, 2.1, 2.2])
    assert raw["tau_by_depth"][-1] == pytest.approx(raw["tau"])
