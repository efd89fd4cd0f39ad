"""Tokenisation and chat templates (a thin wrapper around transformers).

transformers is used only here, for its fast tokenizer and chat-template
rendering; the models never import it. Loaders:

  Tokenizer.from_hf_dir(dir)     tokenizer.json / tokenizer_config.json (+ chat template)
  Tokenizer.from_gguf(file)      the vocabulary, merges and `tokenizer.chat_template`
                                 embedded in a GGUF file
  Tokenizer.load(path)           either of the above
  tok.save(dir)                  writes a directory `from_hf_dir` reads back identically
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
        transformers = _quiet_transformers()
        try:
            hf = transformers.AutoTokenizer.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True)
        except Exception as e:
            raise TokenizerError(f"cannot build a tokenizer from the metadata of {path}: "
                                 f"{type(e).__name__}: {e}") from None
        if not getattr(hf, "chat_template", None):
            # older transformers do not copy the template: take it from the metadata
            import gguf

            field = gguf.GGUFReader(path).fields.get("tokenizer.chat_template")
            if field is not None:
                hf.chat_template = field.contents()
        return cls(hf, eos_token_ids)

    @classmethod
    def load(cls, path: str | os.PathLike, eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        path = os.fspath(path)
        if os.path.isfile(path) and path.endswith(".gguf"):
            return cls.from_gguf(path, eos_token_ids)
        return cls.from_hf_dir(path, eos_token_ids)
