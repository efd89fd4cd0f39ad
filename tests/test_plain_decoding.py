"""Plain (non-speculative) decoding on SmolLM2-135M-Instruct against transformers.

Claims checked:
* greedy decoding of 64 tokens equals transformers' greedy `generate` token for
  token (same GGUF weights in float32), for one chat prompt and for a batch of
  four chat prompts of different lengths (transformers runs each prompt alone,
  unpadded); both stop at EOS and include it;
* a chat prompt is rendered by the model's own chat template (our ids equal
  `apply_chat_template(..., add_generation_prompt=True)`);
* sampling with a fixed seed is reproducible, different seeds differ, and
  top-k = 1 sampling is greedy;
* EOS and per-row `max_new_tokens` (a list) end each row where they should.
"""

from __future__ import annotations

import pytest

from eagle_jax.generate import Generator

MAX_NEW = 64
PROMPTS = [
    "Write a short poem about the sea and the wind over the old harbour at night.",
    "What is the capital of France?",
    "Say hi.",
    "List three colors.",
]
SINGLE = PROMPTS[0]  # runs the full 64 tokens without meeting EOS


@pytest.fixture(scope="module")
def gen(smollm2_target):
    t = smollm2_target
    return Generator(t.cfg, t.params, t.tokenizer)


def _hf_chat_ids(tok, prompt: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  tokenize=True)
    if not isinstance(out, list):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return [int(x) for x in out]


@pytest.fixture(scope="module")
def hf_reference(smollm2_hf_model, smollm2_hf_tokenizer, gen):
    """prompt -> (HF prompt ids, HF greedy continuation with EOS included)."""
    import torch

    eos = list(gen.eos_ids())
    refs = {}
    # One torch thread: token-by-token decoding of a 135M model is dominated by per-op
    # overhead, and with several threads on a shared 2-core machine it runs ~10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for p in PROMPTS:
            ids = _hf_chat_ids(smollm2_hf_tokenizer, p)
            with torch.no_grad():
                out = smollm2_hf_model.generate(
                    torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    do_sample=False, num_beams=1, max_new_tokens=MAX_NEW, eos_token_id=eos,
                    pad_token_id=eos[0], temperature=None, top_p=None, top_k=None)
            refs[p] = (ids, out[0, len(ids):].tolist())
    finally:
        torch.set_num_threads(threads)
    return refs


@pytest.fixture(scope="module")
def greedy_single(gen):
    return gen.generate(SINGLE, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def greedy_batch(gen):
    return gen.generate(PROMPTS, max_new_tokens=MAX_NEW)


def _divergence(model, prompt_ids, ours, ref) -> str:
    """Where two continuations part, and how close the reference's top-2 logits were there."""
    import torch

    j = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    msg = f"first difference at generated position {j} (ours {ours[j:j + 3]}, transformers {ref[j:j + 3]})"
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ref[:j]])).logits[0, -1].double()
    top = torch.topk(logits, 2)
    gap = float(top.values[0] - top.values[1])
    ours_tok = ours[j] if j < len(ours) else None
    ours_gap = float(logits[top.indices[0]] - logits[ours_tok]) if ours_tok is not None else None
    return (f"{msg}; transformers top-2 {top.indices.tolist()} with logit gap {gap:.3g}; "
            f"our token is {ours_gap} below its top-1")


def _check_against_hf(model, prompt, result_ids, hf_reference, eos):
    hf_ids, ref = hf_reference[prompt]
    assert result_ids == ref, _divergence(model, hf_ids, result_ids, ref)
    # the same stopping rule: at most MAX_NEW tokens, EOS included and only at the end
    assert len(ref) == MAX_NEW or ref[-1] in eos
    assert not any(t in eos for t in ref[:-1])


# ----------------------------------------------------------------------------- chat template


def test_chat_prompt_uses_the_models_template(gen, smollm2_hf_tokenizer):
    ours = gen.encode_prompts(PROMPTS, chat=True)
    for p, ids in zip(PROMPTS, ours):
        assert ids == _hf_chat_ids(smollm2_hf_tokenizer, p)
    # the template is really applied (system turn, user turn, open assistant turn)
    text = gen.tokenizer.decode(ours[0])
    assert "<|im_start|>user\n" + PROMPTS[0] in text
    assert text.endswith("<|im_start|>assistant\n")
    # and plain encoding without it is the bare text
    assert gen.encode_prompts([SINGLE], chat=False)[0] == smollm2_hf_tokenizer.encode(SINGLE)


# ----------------------------------------------------------------------------- greedy vs transformers


def test_greedy_single_prompt_matches_transformers(gen, greedy_single, hf_reference, smollm2_hf_model):
    r = greedy_single
    assert r.prompt_tokens == [len(hf_reference[SINGLE][0])]
    assert len(r.token_ids[0]) == MAX_NEW and r.finish_reasons == ["length"]
    _check_against_hf(smollm2_hf_model, SINGLE, r.token_ids[0], hf_reference, gen.eos_ids())
    assert r.texts[0] == gen.tokenizer.decode(r.token_ids[0], skip_special_tokens=True)


def test_greedy_batch_matches_transformers(gen, greedy_batch, hf_reference, smollm2_hf_model):
    r = greedy_batch
    assert len(set(r.prompt_tokens)) == len(PROMPTS), "the batch should mix prompt lengths"
    assert r.prompt_tokens == [len(hf_reference[p][0]) for p in PROMPTS]
    eos = gen.eos_ids()
    for p, ids, reason in zip(PROMPTS, r.token_ids, r.finish_reasons):
        _check_against_hf(smollm2_hf_model, p, ids, hf_reference, eos)
        assert reason == ("eos" if ids[-1] in eos else "length")
    # the batch exercises both endings
    assert "eos" in r.finish_reasons and "length" in r.finish_reasons
    assert r.num_generated == sum(len(x) for x in r.token_ids)


# ----------------------------------------------------------------------------- sampling


def test_sampling_is_seeded(gen):
    kw = dict(max_new_tokens=16, temperature=1.0)
    a = gen.generate(SINGLE, seed=0, **kw).token_ids
    b = gen.generate(SINGLE, seed=0, **kw).token_ids
    c = gen.generate(SINGLE, seed=1, **kw).token_ids
    assert a == b
    assert a != c


def test_top_k_1_sampling_is_greedy(gen, greedy_single):
    # 16 tokens: the same padded cache length as greedy_single (both round up to 128 slots)
    r = gen.generate(SINGLE, max_new_tokens=16, temperature=1.0, top_k=1, seed=123)
    assert r.token_ids[0] == greedy_single.token_ids[0][:16]


# ----------------------------------------------------------------------------- EOS and per-row lengths


def test_eos_and_per_row_max_new_tokens(gen, greedy_batch):
    eos = set(gen.eos_ids())
    # Limits below the greedy length on rows 0 and 3; row 2 keeps 64 and meets EOS first.
    # The padded cache (set by max(prompt + limit)) and output widths stay those of
    # greedy_batch, so the compiled loop is reused; the loop ends after ~24 steps.
    max_new = [24, 10, MAX_NEW, 20]
    r = gen.generate(PROMPTS, max_new_tokens=max_new)
    hit_eos = hit_limit = False
    for row, (ids, full, m, reason) in enumerate(zip(r.token_ids, greedy_batch.token_ids, max_new,
                                                     r.finish_reasons)):
        want = full[:m]
        assert ids == want, f"row {row}"
        assert len(ids) <= m
        assert not any(t in eos for t in ids[:-1]), f"row {row} runs past EOS"
        if ids[-1] in eos:
            assert reason == "eos" and len(ids) <= m
            hit_eos = True
        else:
            assert reason == "length" and len(ids) == m
            hit_limit = hit_limit or m < MAX_NEW
    assert hit_eos and hit_limit, "the prompts should exercise both an EOS and a per-row limit"


def test_prompt_buckets_hold_the_prompt_and_pad_at_most_a_third():
    from eagle_jax.engine.batch import padded_prompt_len

    sizes = {padded_prompt_len(n, 512) for n in range(1, 513)}
    assert sizes == {16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512}
    for n in range(1, 2000):
        b = padded_prompt_len(n, 512)
        assert b >= n and (b <= max(16, 1.5 * n) if n <= 512 else b % 512 == 0 and b - n < 512)
