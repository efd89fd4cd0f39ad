"""Committed self-distillation data: gzip JSONL in git, merged from a working file.

`eagle-jax regenerate` appends to a plain JSONL working file (git-ignored,
e.g. runs/data/sharegpt-regen.jsonl); what it produced is kept by merging it
into the committed, gzip-compressed copy (train/data/sharegpt-regen.jsonl.gz)
and its provenance (train/data/sharegpt-regen.provenance.json):

    python -m eagle_jax.train.datastore merge runs/data/sharegpt-regen.jsonl \\
        train/data/sharegpt-regen.jsonl.gz
    python -m eagle_jax.train.datastore stats train/data/sharegpt-regen.jsonl.gz

A merge appends the records whose id the committed file lacks, in working-file
order, as one new gzip member (the bytes already committed are left as they
are, so git stores each merge as a small delta); it never drops or rewrites a
committed record. A torn last line of the working file (a job killed or
paused mid-write) is ignored. The new file is written beside the old one and
renamed over it, so a killed merge leaves the committed file intact.

`--merge-info JSON` records how the merged records were made (e.g. the
regeneration job's `dtype` and `command`) in that merge's entry of the
provenance. Merge entries carry their `dtype` (entries from before
per-merge dtypes inherit the top-level one); the top-level `dtype` (and
`flags.dtype`) is the one dtype all merges share, or "mixed" with `dtypes`
counting the conversations merged at each.

Readers (`iter_jsonl`, `read_ids`, `read_conversations`) take
`.jsonl` and `.jsonl.gz` alike (standard-library gzip, multi-member files
included). Regeneration resumes from the committed ids with
`eagle-jax regenerate ... --skip-ids-from train/data/sharegpt-regen.jsonl.gz`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator

__all__ = ["is_gzip_path", "open_text", "iter_jsonl", "read_conversations", "read_ids", "provenance_path",
           "answer_texts", "merge", "main"]


def is_gzip_path(path: str | os.PathLike) -> bool:
    return os.fspath(path).endswith(".gz")


def open_text(path: str | os.PathLike, mode: str = "r"):
    """Open a `.jsonl` or `.jsonl.gz` file as UTF-8 text ("r", "w" or "a")."""
    if is_gzip_path(path):
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def _raw_lines(path: str | os.PathLike, stats: dict) -> Iterator[bytes]:
    """Lines of a plain or gzip file as bytes; a gzip stream cut short ends them."""
    opener = gzip.open if is_gzip_path(path) else open
    with opener(path, "rb") as f:
        try:
            yield from f
        except (EOFError, gzip.BadGzipFile, OSError) as e:  # gzip: truncated or damaged tail
            if not is_gzip_path(path):
                raise
            stats["gzip_error"] = f"{type(e).__name__}: {e}"


def iter_jsonl(path: str | os.PathLike, *, stats: dict | None = None,
               lines: list | None = None) -> Iterator[dict]:
    """The JSON objects of a `.jsonl` / `.jsonl.gz` file, one per line, in order.

    Blank lines are skipped. A torn last line (no final newline, or not valid
    JSON and nothing after it) is ignored and noted as ``stats["torn"] = True``;
    a bad line followed by others, or a line that is not a JSON object, raises
    ValueError naming the file and line. If `lines` is a list, each yielded
    record's raw line (bytes, with its newline) is appended to it.
    """
    if stats is None:
        stats = {}
    stats.setdefault("torn", False)
    bad: tuple[int, str] | None = None
    for n, line in enumerate(_raw_lines(path, stats), 1):
        if bad is not None:
            raise ValueError(f"{path}:{bad[0]}: not valid JSON ({bad[1]})")
        if not line.strip():
            continue
        if not line.endswith(b"\n"):
            stats["torn"] = True
            return
        try:
            rec = json.loads(line)
        except ValueError as e:
            bad = (n, str(e))
            continue
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object per line")
        if lines is not None:
            lines.append(line)
        yield rec
    if bad is not None or stats.get("gzip_error"):
        stats["torn"] = True


def read_ids(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> set[str]:
    """Ids of the records in one or several (comma-separated or listed) files;
    a missing file has none."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [p.strip() for p in os.fspath(paths).split(",") if p.strip()]
    out: set[str] = set()
    for p in paths:
        if Path(p).is_file():
            out.update(str(r["id"]) for r in iter_jsonl(p) if "id" in r)
    return out



def read_conversations(source: str, limit: int | None):
    """Normalised conversations from ShareGPT or a JSONL file (`.jsonl` or gzip
    `.jsonl.gz`, e.g. the committed train/data/sharegpt-regen.jsonl.gz); several
    sources separated by commas are concatenated (`limit` applies to each). A
    torn last line (a file still being appended to) is ignored."""
    from eagle_jax.train import data

    if source and "," in source:
        return [c for part in source.split(",") for c in read_conversations(part.strip(), limit)]
    if source in ("sharegpt", "", None):
        return list(data.iter_sharegpt(limit=limit))
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} not found (use 'sharegpt', a .jsonl or a .jsonl.gz path)")
    out = []
    for n, rec in enumerate(iter_jsonl(path), 1):
        if "messages" in rec:
            conv = {"id": str(rec.get("id", n)), "messages": rec["messages"]}
        elif "conversations" in rec:
            conv = data.normalize_conversation(rec)
        else:
            raise ValueError(f"{path}: record {n}: expected a 'messages' or 'conversations' key")
        if conv is not None:
            out.append(conv)
        if limit is not None and len(out) >= limit:
            break
    return out

def provenance_path(data_path: str | os.PathLike) -> Path:
    """train/data/x.jsonl.gz -> train/data/x.provenance.json"""
    p = Path(data_path)
    name = p.name
    for suf in (".gz", ".jsonl", ".json"):
        if name.endswith(suf):
            name = name[: -len(suf)]
    return p.with_name(name + ".provenance.json")


def answer_texts(rec: dict) -> list[str]:
    """The regenerated answers of a record: its last `regenerated_turns` assistant turns."""
    k = int(rec.get("regenerated_turns") or 0)
    if k <= 0:
        return []
    answers = [m.get("content", "") for m in rec.get("messages", []) if m.get("role") == "assistant"]
    return answers[-k:]


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def _check(rec: dict, path, n: int) -> str:
    cid = rec.get("id")
    if not isinstance(cid, str) or not cid or not isinstance(rec.get("messages"), list):
        raise ValueError(f"{path}: record {n}: expected {{'id': str, 'messages': [...]}}")
    return cid


def _counts(recs: Iterable[dict], heldout: Callable[[str], bool] | None,
            count_tokens: Callable[[list[str]], int] | None) -> dict:
    c = {"conversations": 0, "regenerated": 0, "copied_unchanged": 0, "heldout": 0, "truncated": 0,
         "regenerated_turns": 0}
    texts: list[str] = []
    for r in recs:
        c["conversations"] += 1
        k = int(r.get("regenerated_turns") or 0)
        c["regenerated" if k > 0 else "copied_unchanged"] += 1
        c["regenerated_turns"] += k
        c["truncated"] += bool(r.get("truncated"))
        if heldout is not None and heldout(r["id"]):
            c["heldout"] += 1
        texts.extend(answer_texts(r))
    if count_tokens is not None:
        c["answer_tokens"] = int(count_tokens(texts))
    c["answer_chars"] = sum(len(t) for t in texts)
    return c


def _add_counts(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = out.get(k, 0) + v
    return out


def merge(working: str | os.PathLike | Iterable[str | os.PathLike], committed: str | os.PathLike, *,
          provenance: str | os.PathLike | None = None, info: dict | None = None,
          merge_info: dict | None = None,
          heldout: Callable[[str], bool] | None = None,
          count_tokens: Callable[[list[str]], int] | None = None, dry_run: bool = False) -> dict:
    """Append the records of `working` (one path or several) whose id `committed`
    lacks to `committed` (a `.jsonl.gz`, created if missing), deduplicated by id,
    and update the provenance JSON (default: `provenance_path(committed)`).

    `info` updates the provenance's top-level keys (target, command, ...) on
    the first merge; later merges keep what is there and only fill in missing
    keys. `merge_info` (how these records were made: dtype, command, ...) goes
    into this merge's entry (see the module docstring for dtypes).
    `heldout(id)` and `count_tokens(texts)` (optional) add held-out and
    answer-token counts. Returns the merge's counts.
    """
    committed = Path(committed)
    if not is_gzip_path(committed):
        raise ValueError(f"{committed}: the committed file must be a .jsonl.gz")
    working = [Path(working)] if isinstance(working, (str, os.PathLike)) else [Path(w) for w in working]
    prov_path = Path(provenance) if provenance else provenance_path(committed)

    have: set[str] = set()
    n_committed = 0
    cstats: dict = {}
    if committed.is_file():
        for n, r in enumerate(iter_jsonl(committed, stats=cstats), 1):
            have.add(_check(r, committed, n))
            n_committed += 1
        if cstats["torn"]:
            raise ValueError(f"{committed}: damaged last record ({cstats.get('gzip_error', 'torn line')}); "
                             "restore it from git before merging")
    new_lines: list[bytes] = []
    new_recs: list[dict] = []
    dup = torn = 0
    read = 0
    for w in working:
        if not w.is_file():
            raise FileNotFoundError(f"working file {w} not found")
        wstats: dict = {}
        raw: list[bytes] = []
        for n, r in enumerate(iter_jsonl(w, stats=wstats, lines=raw), 1):
            read += 1
            cid = _check(r, w, n)
            if cid in have:
                dup += 1
                continue
            have.add(cid)
            new_lines.append(raw[-1])  # iter_jsonl yields only newline-terminated lines
            new_recs.append(r)
        torn += bool(wstats["torn"])
    added = _counts(new_recs, heldout, count_tokens)
    result = {"committed_before": n_committed, "read": read, "added": len(new_recs),
              "already_committed": dup, "torn_tails_ignored": torn,
              "committed_after": n_committed + len(new_recs), "added_counts": added}
    if dry_run:
        return result

    if new_lines:
        tmp = committed.with_name(committed.name + ".tmp")
        committed.parent.mkdir(parents=True, exist_ok=True)
        if committed.is_file():
            shutil.copyfile(committed, tmp)
        else:
            tmp.write_bytes(b"")
        # one new gzip member; mtime=0 and no file name keep the bytes reproducible
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
            gz.write(b"".join(new_lines))
        with open(tmp, "ab") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, committed)

    prov = json.loads(prov_path.read_text()) if prov_path.is_file() else {}
    now = _now()
    for k, v in (info or {}).items():
        prov.setdefault(k, v)
    prov.setdefault("created", now)
    if new_recs or "counts" not in prov:
        prov["updated"] = now
        prov["file"] = committed.name
        prov["bytes"] = committed.stat().st_size if committed.is_file() else 0
        totals = _add_counts(prov.get("counts", {}), added)
        totals["conversations"] = n_committed + len(new_recs)
        prov["counts"] = totals
        ids = prov.get("ids", {})
        if new_recs:
            ids.setdefault("first", new_recs[0]["id"])
            ids["last"] = new_recs[-1]["id"]
        prov["ids"] = ids
        entry = {"date": now, "added": len(new_recs), "conversations_after": n_committed + len(new_recs),
                 "from": [os.fspath(w) for w in working], "git_head": _git_head(),
                 **{k: added[k] for k in ("answer_tokens",) if k in added}, **(merge_info or {})}
        if new_recs:
            prov.setdefault("merges", []).append(entry)
            _summarise_dtypes(prov)
        prov_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = prov_path.with_name(prov_path.name + ".tmp")
        tmp.write_text(json.dumps(prov, indent=2, ensure_ascii=False) + "\n")
        os.replace(tmp, prov_path)
    result["provenance"] = os.fspath(prov_path)
    return result


MIXED = "mixed (see dtypes and merges[].dtype)"


def _summarise_dtypes(prov: dict) -> None:
    """Give every merge entry a dtype (older ones: the single top-level dtype they were made with),
    then set the top-level ``dtype`` / ``flags.dtype`` to the common one or MIXED, and ``dtypes``."""
    merges = prov.get("merges", [])
    legacy = prov.get("dtype") if prov.get("dtype") != MIXED else None
    for m in merges:
        if "dtype" not in m and legacy is not None:
            m["dtype"] = legacy
    counts: dict = {}
    for m in merges:
        if "dtype" in m:
            counts[m["dtype"]] = counts.get(m["dtype"], 0) + int(m.get("added", 0))
    if not counts:
        return
    prov["dtype"] = next(iter(counts)) if len(counts) == 1 else MIXED
    prov["dtypes"] = counts
    if isinstance(prov.get("flags"), dict) and "dtype" in prov["flags"]:
        prov["flags"]["dtype"] = prov["dtype"]


def _token_counter(target: str) -> Callable[[list[str]], int]:
    """Counts tokens of texts with the target's tokenizer (no model weights loaded)."""
    from eagle_jax.convert.registry import _resolve
    from eagle_jax.tokenizer import Tokenizer

    kind, path, _ = _resolve(target)
    tok = Tokenizer.from_gguf(path) if kind == "gguf" else Tokenizer.from_hf_dir(path)

    def count(texts: list[str]) -> int:
        if not texts:
            return 0
        return sum(len(ids) for ids in tok.hf(texts, add_special_tokens=False)["input_ids"])

    return count


def _stats(path: str) -> dict:
    from eagle_jax.train.data import is_heldout

    st: dict = {}
    recs = list(iter_jsonl(path, stats=st))
    ids = [r.get("id") for r in recs]
    out = _counts(recs, lambda i: is_heldout(i, 0.02), None)
    out.update(path=path, duplicate_ids=len(ids) - len(set(ids)), torn_tail=st["torn"],
               bytes=os.path.getsize(path), first_id=ids[0] if ids else None, last_id=ids[-1] if ids else None)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_jax.train.datastore", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="append the new ids of working JSONL files to the committed .jsonl.gz")
    m.add_argument("working", nargs="+", help="working JSONL file(s) written by eagle-jax regenerate")
    m.add_argument("committed", help="the committed .jsonl.gz (created if missing)")
    m.add_argument("--provenance", help="provenance JSON (default: <name>.provenance.json beside it)")
    m.add_argument("--info", help="JSON object of provenance keys to set when missing (target, command, ...)")
    m.add_argument("--merge-info", help="JSON object recorded in this merge's entry: how its records were made "
                                        "(e.g. '{\"dtype\": \"bfloat16\", \"command\": \"eagle-jax regenerate ...\"}')")
    m.add_argument("--heldout-fraction", type=float, default=0.02, help="for the held-out count")
    m.add_argument("--target", default=None,
                   help="tokenizer for the answer-token count (default: the provenance's target)")
    m.add_argument("--no-tokens", action="store_true", help="skip the answer-token count")
    m.add_argument("--dry-run", action="store_true", help="report what would be added; write nothing")
    s = sub.add_parser("stats", help="counts of a .jsonl / .jsonl.gz file")
    s.add_argument("path")
    args = p.parse_args(argv)
    if args.cmd == "stats":
        print(json.dumps(_stats(args.path), indent=2))
        return 0
    from eagle_jax.train.data import is_heldout

    info = json.loads(args.info) if args.info else {}
    merge_info = json.loads(args.merge_info) if args.merge_info else None
    if merge_info is not None and not isinstance(merge_info, dict):
        p.error(f"--merge-info must be a JSON object, got {args.merge_info!r}")
    prov = Path(args.provenance) if args.provenance else provenance_path(args.committed)
    target = args.target or info.get("target") or (
        json.loads(prov.read_text()).get("target") if prov.is_file() else None) or "smollm2-135m-instruct"
    counter = None if args.no_tokens else _token_counter(target)
    res = merge(args.working, args.committed, provenance=prov, info=info, merge_info=merge_info,
                heldout=lambda i: is_heldout(i, args.heldout_fraction), count_tokens=counter,
                dry_run=args.dry_run)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
