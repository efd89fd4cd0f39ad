"""Tokenisation and chat templates (a thin wrapper around transformers).

transformers is used only here, for its fast tokenizer and chat-template
rendering; the models never import it. Loaders:

  Tokenizer.from_hf_dir(dir)     tokenizer.json / tokenizer_config.json (+ chat template)
  Tokenizer.from_gguf(file)      the vocabulary, merges and `tokenizer.chat_template`
                                 embedded in a GGUF file
  Tokenizer.load(path)           either of the above
  tok.save(dir)                  writes a directory `from_hf_dir` reads back identically

A GGUF file's tokenizer is rebuilt here from its metadata with the `tokenizers`
package (no PyTorch, which transformers' own GGUF loader needs). Supported
`tokenizer.ggml.model`s: "gpt2" (byte-level BPE: SmolLM2, Llama 3, Qwen2/2.5/3,
Mistral Nemo, ...; the split regex follows `tokenizer.ggml.pre`, see
`_GGUF_PRE_TOKENIZERS`) and "llama" (SentencePiece BPE with byte fallback:
Llama 2, Mistral 7B, ...). It matches transformers' GGUF conversion token for
token, except where that departs from llama.cpp (the runtime these files are
written for) and from the model's own tokenizer.json: digits are split one by
one for "smollm"/"starcoder"-style pre-tokenizers, the Llama 3 family (and
"tekken") keeps a word that is a whole vocabulary entry whole (`ignore_merges`)
and adds BOS when the file does not say, control tokens are special whatever
their spelling, and "llama" files honour `tokenizer.ggml.add_space_prefix`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["Tokenizer", "TokenizerError"]

_EXTRA_FILE = "eagle_tokenizer.json"
# End-of-turn markers of common chat formats: when the chat template emits one,
# generation must stop on it even if the tokenizer's eos is another token.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


class TokenizerError(ValueError):
    """A tokenizer is missing, unreadable or lacks what was asked of it (a chat template)."""


def _quiet_transformers():
    """transformers, its logging at errors only (from its import on: without PyTorch it would
    say so on import, and the tokenizers here do not need it)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


class Tokenizer:
    """Encode/decode text and apply the model's chat template.

    `eos_token_ids` are every id that ends generation: the tokenizer's eos,
    ids passed in (config / generation_config), and the chat format's
    end-of-turn token (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3).
    """

    def __init__(self, hf_tokenizer, eos_token_ids: Iterable[int] = ()):
        self.hf = hf_tokenizer
        ids: list[int] = [int(i) for i in eos_token_ids]
        if hf_tokenizer.eos_token_id is not None:
            ids.append(int(hf_tokenizer.eos_token_id))
        template = self.chat_template or ""
        vocab = hf_tokenizer.get_vocab()
        for tok in _END_OF_TURN:
            if tok in template and tok in vocab:
                ids.append(int(vocab[tok]))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))

    def __repr__(self):
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids}, "
                f"pad_id={self.pad_id}, chat_template={'yes' if self.chat_template else 'no'})")

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def pad_id(self) -> int:
        if self.hf.pad_token_id is not None:
            return int(self.hf.pad_token_id)
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    @property
    def bos_id(self) -> int | None:
        return None if self.hf.bos_token_id is None else int(self.hf.bos_token_id)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    # ------------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: str | Sequence[Mapping], add_generation_prompt: bool = True,
                    **template_kwargs) -> str:
        """The chat template applied to `messages` (a list of {role, content}, or one user string)."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template; use encode() on plain text")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.hf.apply_chat_template(list(messages), tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           **template_kwargs)

    def apply_chat(self, messages: str | Sequence[Mapping], add_generation_prompt: bool = True,
                   **template_kwargs) -> list[int]:
        """Token ids of the chat-templated conversation (special tokens come from the template)."""
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ io
    def save(self, directory: str | os.PathLike) -> None:
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        self.hf.save_pretrained(directory)
        with open(os.path.join(directory, _EXTRA_FILE), "w") as f:
            json.dump({"eos_token_ids": list(self.eos_token_ids)}, f)

    @staticmethod
    def has_tokenizer(directory: str | os.PathLike) -> bool:
        d = os.fspath(directory)
        return any(os.path.isfile(os.path.join(d, f)) for f in
                   ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"))

    @classmethod
    def from_hf_dir(cls, directory: str | os.PathLike, eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"tokenizer directory {directory!r} does not exist")
        if not cls.has_tokenizer(directory):
            raise TokenizerError(f"no tokenizer files (tokenizer.json, tokenizer_config.json) "
                                 f"in {directory}")
        transformers = _quiet_transformers()
        # A directory written by `save` holds the complete tokenizer.json that
        # the model-specific class produced, so the generic fast class reads it
        # back identically, without AutoTokenizer's imports (torch: ~2.5 s).
        ours = all(os.path.isfile(os.path.join(directory, f)) for f in (_EXTRA_FILE, "tokenizer.json"))
        cls_ = transformers.PreTrainedTokenizerFast if ours else transformers.AutoTokenizer
        try:
            hf = cls_.from_pretrained(directory, local_files_only=True)
        except Exception as e:
            raise TokenizerError(f"cannot load the tokenizer in {directory}: "
                                 f"{type(e).__name__}: {e}") from None
        eos = list(eos_token_ids)
        for name, key in (("generation_config.json", "eos_token_id"), (_EXTRA_FILE, "eos_token_ids")):
            p = os.path.join(directory, name)
            if os.path.isfile(p):
                try:
                    with open(p) as f:
                        value = json.load(f).get(key)
                except (OSError, json.JSONDecodeError, AttributeError):
                    value = None
                if isinstance(value, int):
                    eos.append(value)
                elif isinstance(value, list):
                    eos.extend(v for v in value if isinstance(v, int))
        return cls(hf, eos)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        path = os.path.abspath(os.fspath(path))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file {path!r} does not exist")
        return cls(_gguf_tokenizer(path), eos_token_ids)

    @classmethod
    def load(cls, path: str | os.PathLike, eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        path = os.fspath(path)
        if os.path.isfile(path) and path.endswith(".gguf"):
            return cls.from_gguf(path, eos_token_ids)
        return cls.from_hf_dir(path, eos_token_ids)


# ----------------------------------------------------------------------------- GGUF metadata

# llama.cpp's `tokenizer.ggml.token_type` values (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# Split regexes of the byte-level pre-tokenizers, as the models' own tokenizer.json
# spell them (llama.cpp's llama-vocab.cpp rewrites a few for std::regex).
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer_table() -> dict[str, tuple[str | None, bool, bool]]:
    """`tokenizer.ggml.pre` -> (split, ignore_merges, add_bos when the file does not say), after
    llama.cpp's llama-vocab.cpp. split: a regex, "gpt2" (GPT-2's own regex) or "digits" (each
    digit alone, then GPT-2's regex: StarCoder's tokenizer, which SmolLM uses)."""
    table: dict[str, tuple[str | None, bool, bool]] = {}
    groups = [
        (("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "exaone4", "gigachat", "mellum", "a.x-4.0"),
         "gpt2", False, False),
        (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
         "digits", False, False),
        (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
         _LLAMA3_SPLIT, True, True),
        (("dbrx", "smaug-bpe"), _LLAMA3_SPLIT, False, False),
        (("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _QWEN2_SPLIT, False, False),
        (("qwen35",), _QWEN35_SPLIT, False, False),
        (("tekken",), _TEKKEN_SPLIT, True, True),
        (("gpt-4o", "llama4", "kanana2", "minimax-m2"), _GPT4O_SPLIT, False, False),
    ]
    for names, split, ignore_merges, add_bos in groups:
        for name in names:
            table[name] = (split, ignore_merges, add_bos)
    return table


_GGUF_PRE_TOKENIZERS = _pre_tokenizer_table()


def _gguf_fields(path: str, prefix: str = "tokenizer.") -> dict:
    """The metadata of a GGUF file (`gguf.GGUFReader`) whose key starts with `prefix`: scalars
    as Python values, arrays as lists."""
    import gguf

    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError / struct errors on a bad file
        raise TokenizerError(f"cannot read the metadata of {path} (not a GGUF file?): "
                             f"{type(e).__name__}: {e}") from None
    out = {}
    for key, field in reader.fields.items():
        if key.startswith(prefix):
            value = field.contents()
            out[key] = value.item() if hasattr(value, "item") else value
    return out


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character (the printable
    Latin-1 bytes as themselves, the others as U+0100 onwards, in byte order)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    spelling = {b: chr(b) for b in printable}
    spelling.update({b: chr(0x100 + i) for i, b in enumerate(others)})
    return spelling


def _byte_level_bpe(tokens, types, merges, pre: str):
    """llama.cpp's "gpt2" vocabulary: byte-level BPE, split as `tokenizer.ggml.pre` says."""
    from tokenizers import Regex, Tokenizer as Backend, decoders, models, pre_tokenizers

    if pre not in _GGUF_PRE_TOKENIZERS:
        raise TokenizerError(f"GGUF tokenizer model 'gpt2' with pre-tokenizer {pre!r} is not supported "
                             f"(supported: {', '.join(sorted(_GGUF_PRE_TOKENIZERS))})")
    split, ignore_merges, add_bos = _GGUF_PRE_TOKENIZERS[pre]
    if merges is None:
        raise TokenizerError("GGUF tokenizer model 'gpt2' without tokenizer.ggml.merges")
    # Normal tokens are spelled in GPT-2's byte alphabet; a few converters wrote some in plain
    # UTF-8: spell those in the alphabet too. Control and user-defined tokens keep their text:
    # they are matched in the input as written, before any byte mapping (as llama.cpp does).
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {}
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind not in (_CONTROL, _USER_DEFINED, _UNKNOWN) and not set(tok) <= alphabet:
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    kw = {"ignore_merges": True} if ignore_merges else {}
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                 end_of_word_suffix="", fuse_unk=False, **kw))
    if split == "gpt2":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, vocab, add_bos


def _sentencepiece_bpe(tokens, scores, merges, add_space_prefix: bool):
    """llama.cpp's "llama" vocabulary: SentencePiece BPE with byte fallback (`<0x0A>` tokens),
    `▁` for spaces. Without merges in the file they come from the scores: every pair of
    tokens whose concatenation is a token, best-scored concatenation first."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers

    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        if scores is None or len(scores) < len(tokens):
            raise TokenizerError("GGUF tokenizer model 'llama' without tokenizer.ggml.merges or scores")
        found = []  # (score, left, right) in vocabulary order, each token's splits by their ids
        for tok, score in zip(tokens, scores):
            splits = [(tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
            splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
            found.extend((float(score), left, right) for left, right in splits)
        found.sort(key=lambda f: (f[0], len(f[1]), len(f[2])), reverse=True)  # stable
        pairs = [(left, right) for _, left, right in found]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend, vocab


def _gguf_tokenizer(path: str):
    """A transformers fast tokenizer (no PyTorch) built from the `tokenizer.*` metadata of the
    GGUF file at `path`: vocabulary, merges, pre-tokenizer, special tokens, BOS/EOS adding and
    chat template."""
    from tokenizers import AddedToken, processors

    meta = _gguf_fields(path)
    model = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError(f"{path} holds no tokenizer (no tokenizer.ggml.tokens in its metadata)")
    tokens = [str(t) for t in tokens]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or ()] or [_NORMAL] * len(tokens)
    if len(types) < len(tokens):
        raise TokenizerError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
                             f"{len(tokens)} tokens")
    merges = meta.get("tokenizer.ggml.merges")
    try:
        if model == "gpt2":
            backend, vocab, add_bos = _byte_level_bpe(tokens, types, merges, pre)
        elif model == "llama":
            backend, vocab = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores"), merges,
                                                bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
            add_bos = True
        else:
            raise TokenizerError(f"GGUF tokenizer model {model!r} (pre-tokenizer {pre!r}) is not supported "
                                 f"(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
    except TokenizerError as e:
        raise TokenizerError(f"{path}: {e}") from None
    if len(vocab) != len(tokens):
        raise TokenizerError(f"{path}: the GGUF vocabulary repeats {len(tokens) - len(vocab)} token(s)")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))

    spelled = {i: t for t, i in vocab.items()}  # as the vocabulary holds them

    def named(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return spelled.get(int(i)) if i is not None else None

    special = {"bos_token": named("bos_token_id"), "eos_token": named("eos_token_id"),
               "unk_token": named("unknown_token_id"), "pad_token": named("padding_token_id")}
    # Control (and unknown) tokens are special, user-defined ones plain added tokens: both are
    # matched whole in the text instead of being cut into pieces.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, kind in zip(tokens, types) if kind in (_CONTROL, _UNKNOWN)]
                               + [AddedToken(t, normalized=False, special=True)
                                  for t in special.values() if t is not None])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    if len(backend.get_vocab()) != len(tokens):
        raise TokenizerError(f"{path}: the special tokens do not all name vocabulary entries")
    if add_bos and special["bos_token"] is None or add_eos and special["eos_token"] is None:
        raise TokenizerError(f"{path}: the metadata asks to add BOS/EOS but names no such token")
    bos, eos = special["bos_token"], special["eos_token"]
    single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
    pair = " ".join([single] + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else []))
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=[(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on])

    transformers = _quiet_transformers()
    template = meta.get("tokenizer.chat_template")
    kwargs = {k: v for k, v in special.items() if v is not None}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, add_bos_token=add_bos, add_eos_token=add_eos,
        clean_up_tokenization_spaces=False, chat_template=str(template) if template else None, **kwargs)
