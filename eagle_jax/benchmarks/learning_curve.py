"""Learning curve: one point per trained drafter, measured on fixed held-out sets.

    eagle-jax bench --suite learning-curve --draft train/state/eagle3.1 [--label NAME]
    python -m eagle_jax.benchmarks.learning_curve --draft runs/x/drafter --label x
    python -m eagle_jax.benchmarks.learning_curve --make-heldout    # once: writes HELDOUT_SET

Each point is one line of ``benchmarks/results/learning_curve.jsonl`` (schema
in `validate_point`): what the drafter was trained on (token positions seen,
data mix, settings: from a committed training state, train/state.py, or from
the trainer at the end of a run with ``learning_curve: true``) and, at one
fixed setting, how well it drafts:

* ``teacher_forced``: `teacher_forced.step_accuracy` (top-1 per TTT step,
  strict and in-vocabulary) over the committed held-out answers;
* ``tau``: engine acceptance length through `Generator` at float32, greedy,
  batch 1, ``MAX_NEW_TOKENS`` new tokens, for chain k=4, the tree 4x3x12 and
  (from 2026-12-06 on) chain k=5, the issue's stretch setting (pinned, whatever
  the defaults become), per prompt set (HumanEval, held-out ShareGPT) and
  pooled (``all``: 1 + accepted drafts / verify steps over every prompt). A
  point lists the engines it measured in ``setting.engines``; the first two
  are in every point.

The held-out set (HELDOUT_SET, gzip JSONL, committed) is fixed so that points
compare: its first line (``"set": "about"``) says how it was made; then
``SET_SIZES["answers"]`` held-out ShareGPT first turns answered by the target
(`teacher_forced.heldout_answers`, float32 greedy; ``"set": "answers"``) and
the engine prompts (``"set": "humaneval"`` / ``"sharegpt"``, the first
problems / held-out first turns of benchmarks/datasets.py). Regenerating it
starts a new curve: `--make-heldout` refuses to overwrite it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gzip
import hashlib
import io
import json
import os
import sys
import time
from pathlib import Path

from eagle_jax.benchmarks.harness import RESULTS_DIR, _aggregate_acceptance, command_line
from eagle_jax.config import SpecConfig
from eagle_jax.runtime import machine_info

__all__ = ["HELDOUT_SET", "CURVE_FILE", "ENGINES", "ALWAYS_MEASURED", "make_heldout_set", "write_heldout_set",
           "read_heldout_set", "measure_tau", "measure", "make_point", "validate_point", "append_point",
           "read_curve", "run_point", "summary_line", "main"]

HELDOUT_SET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts", "learning-curve-heldout.jsonl.gz")
CURVE_FILE = os.path.join(RESULTS_DIR, "learning_curve.jsonl")
SCHEMA = 1
SET_SIZES = {"answers": 24, "answer_tokens": 160, "answer_prompt_tokens": 256, "humaneval": 6, "sharegpt": 6,
             "sharegpt_max_tokens": 256, "heldout_fraction": 0.02}
MAX_NEW_TOKENS = 64
TTT_STEPS = 3
TF_SEQ_LEN = 448  # 256 prompt + 160 answer tokens + the chat template fit
# Pinned, not the defaults, so that points stay comparable when the defaults change.
_TREE = SpecConfig("tree", tree_top_k=4, tree_depth=3, tree_total_tokens=12, disable_by_batch_size=None)
ENGINES = {"chain-k4": SpecConfig("chain", num_speculative_tokens=4, disable_by_batch_size=None),
           f"tree-{_TREE.tree_top_k}x{_TREE.tree_depth}x{_TREE.tree_total_tokens}": _TREE,
           "chain-k5": SpecConfig("chain", num_speculative_tokens=5, disable_by_batch_size=None)}
ALWAYS_MEASURED = tuple(ENGINES)[:2]  # points before 2026-12-06 have only these
PROMPT_SETS = ("humaneval", "sharegpt")


# ----------------------------------------------------------------------------- the held-out set

def make_heldout_set(gen, sizes: dict = SET_SIZES) -> list[dict]:
    """Records of the held-out set (module docstring) built with `gen` (a float32 plain Generator)."""
    import jax

    from eagle_jax.benchmarks import datasets, teacher_forced
    from eagle_jax.train.datastore import _git_head

    answers = teacher_forced.heldout_answers(gen, sizes["answers"], sizes["answer_tokens"],
                                             sizes["answer_prompt_tokens"], sizes["heldout_fraction"])
    suite = datasets.build_suite(gen.tokenizer, humaneval=sizes["humaneval"], sharegpt=sizes["sharegpt"],
                                 sharegpt_max_tokens=sizes["sharegpt_max_tokens"])
    about = {"set": "about", "date": _dt.date.today().isoformat(), "sizes": dict(sizes),
             "answers": "teacher_forced.heldout_answers: the first held-out (train/data.py is_heldout) ShareGPT "
                        "first turns of <= answer_prompt_tokens chat tokens, answered by the target, plain "
                        "greedy, answer_tokens new tokens at most",
             "prompts": "benchmarks/datasets.py build_suite: the first HumanEval problems and the first held-out "
                        "ShareGPT first turns of 16..sharegpt_max_tokens chat tokens",
             "target_dtype": str(gen.target_params["embed"].dtype), "jax": jax.__version__,
             "git_head": _git_head(), "command": command_line()}
    return ([about] + [{"set": "answers", **a} for a in answers]
            + [{"set": name, "id": p.id, "text": p.text} for name in PROMPT_SETS for p in suite[name]])


def write_heldout_set(records: list[dict], path: str | os.PathLike = HELDOUT_SET) -> Path:
    """One gzip member, no name or mtime: the same records give the same bytes. Never overwrites."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists: the held-out set is fixed (a new one starts a new curve)")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return path


def read_heldout_set(path: str | os.PathLike = HELDOUT_SET) -> dict:
    """{"about", "answers": [{"id", "messages"}], "humaneval"/"sharegpt": [{"id", "text"}], "sha1"}."""
    from eagle_jax.train.datastore import iter_jsonl

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"held-out set {path} not found (python -m eagle_jax.benchmarks.learning_curve "
                                "--make-heldout writes it once)")
    out: dict = {"answers": [], **{name: [] for name in PROMPT_SETS}}
    for rec in iter_jsonl(path):
        kind = rec.pop("set", None)
        if kind == "about":
            out["about"] = rec
        elif kind in out:
            out[kind].append(rec)
        else:
            raise ValueError(f"{path}: unknown record set {kind!r}")
    if "about" not in out or not out["answers"] or not all(out[n] for n in PROMPT_SETS):
        raise ValueError(f"{path}: expected an 'about' line, answers and {'/'.join(PROMPT_SETS)} prompts")
    out["sha1"] = hashlib.sha1(path.read_bytes()).hexdigest()[:12]
    return out


# ----------------------------------------------------------------------------- measuring

def _acceptance(stats: list[dict]) -> dict:
    a = _aggregate_acceptance([{"stats": s} for s in stats])
    return {"tau": a["acceptance_length"], "per_position": [round(x, 4) for x in a["per_position_acceptance"]],
            "verify_steps": a["num_verify_steps"], "accepted": a["accepted_tokens"], "prompts": len(stats)}


def measure_tau(tcfg, tparams, tokenizer, bundle, prompts: dict[str, list[str]], spec: SpecConfig,
                max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    """Greedy acceptance of drafter `bundle` (cfg, params, vocab) per prompt set and pooled ("all").

    Every prompt runs alone (batch 1); all share one compiled prompt width.
    """
    from eagle_jax.engine.batch import padded_prompt_len
    from eagle_jax.generate import Generator

    gen = Generator(tcfg, tparams, tokenizer, drafter=bundle, spec=spec)
    ids = {name: gen.encode_prompts(texts) for name, texts in prompts.items()}
    gen.min_shapes = (padded_prompt_len(max(len(x) for v in ids.values() for x in v), gen.prefill_chunk), 0, 0)
    stats = {name: [gen.generate([x], max_new_tokens=max_new_tokens).stats for x in v] for name, v in ids.items()}
    out = {name: _acceptance(s) for name, s in stats.items()}
    out["all"] = _acceptance([s for v in stats.values() for s in v])
    return out


def measure(tcfg, tparams, tokenizer, bundle, heldout: dict) -> dict:
    """{"teacher_forced", "tau": {engine: measure_tau}, "wall_s"} of one drafter; float32 target only."""
    import jax.numpy as jnp

    from eagle_jax.benchmarks import teacher_forced
    from eagle_jax.config import ConfigError

    if tparams["embed"].dtype != jnp.float32:
        raise ConfigError(f"learning-curve points are measured at float32; the target is {tparams['embed'].dtype}")
    dcfg, dparams, vocab = bundle
    t0 = time.perf_counter()
    tf = teacher_forced.step_accuracy(tcfg, tparams, tokenizer, dcfg, dparams, vocab, heldout["answers"],
                                      steps=TTT_STEPS, seq_len=TF_SEQ_LEN)
    prompts = {name: [p["text"] for p in heldout[name]] for name in PROMPT_SETS}
    tau = {name: measure_tau(tcfg, tparams, tokenizer, bundle, prompts, spec) for name, spec in ENGINES.items()}
    return {"teacher_forced": tf, "tau": tau, "wall_s": round(time.perf_counter() - t0, 1)}


# ----------------------------------------------------------------------------- points

def make_point(label: str, drafter: str, variant: str, training: dict, measured: dict, heldout: dict) -> dict:
    """One learning-curve record (see `validate_point`)."""
    return {
        "schema": SCHEMA, "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "label": label, "variant": variant, "drafter": drafter, "training": training,
        "heldout_set": {"file": os.path.basename(HELDOUT_SET), "sha1": heldout["sha1"],
                        "answers": [a["id"] for a in heldout["answers"]],
                        **{name: [p["id"] for p in heldout[name]] for name in PROMPT_SETS}},
        "setting": {"dtype": "float32", "temperature": 0.0, "batch_size": 1, "max_new_tokens": MAX_NEW_TOKENS,
                    "ttt_steps": TTT_STEPS, "engines": {n: _spec_dict(s) for n, s in ENGINES.items()}},
        **measured,
        "machine": machine_info()["description"], "command": command_line(),
    }


def _spec_dict(s: SpecConfig) -> dict:
    if s.method == "chain":
        return {"method": "chain", "k": s.num_speculative_tokens}
    return {"method": "tree", "top_k": s.tree_top_k, "depth": s.tree_depth, "total_tokens": s.tree_total_tokens}


_TYPES = {"schema": int, "date": str, "label": str, "variant": str, "drafter": str, "training": dict,
          "heldout_set": dict, "setting": dict, "teacher_forced": dict, "tau": dict}
_TRAINING = {"token_positions": (int, type(None)), "token_positions_source": str, "data": (list, type(None)),
             "settings": (dict, type(None))}


def validate_point(p: dict) -> dict:
    """`p` if it is a well-formed point, else ValueError naming the first bad field.

    Required: schema, date, label, variant (eagle3 | eagle3.1), drafter, training {token_positions (int
    or null), token_positions_source, data (list of {source, ...} or null), settings (dict or null)},
    heldout_set {sha1, ...}, setting, teacher_forced {strict, in_vocab: one float in [0, 1] per TTT step},
    tau {engine: {set: {tau >= 1 or null, per_position, verify_steps}}} with every engine the point's
    setting.engines lists (ALWAYS_MEASURED at least) and every prompt set plus "all".
    """
    for key, t in _TYPES.items():
        if not isinstance(p.get(key), t):
            raise ValueError(f"learning-curve point: {key!r} must be a {t.__name__}, got {p.get(key)!r}")
    if p["variant"] not in ("eagle3", "eagle3.1"):
        raise ValueError(f"learning-curve point: variant must be eagle3 or eagle3.1, got {p['variant']!r}")
    for key, t in _TRAINING.items():
        if key not in p["training"] or not isinstance(p["training"][key], t):
            raise ValueError(f"learning-curve point: training.{key} missing or of the wrong type")
    for key in ("strict", "in_vocab"):
        v = p["teacher_forced"].get(key)
        if not isinstance(v, list) or not v or not all(isinstance(x, float) and 0 <= x <= 1 for x in v):
            raise ValueError(f"learning-curve point: teacher_forced.{key} must list accuracies in [0, 1]")
    listed = p["setting"].get("engines")
    if not isinstance(listed, dict) or not set(ALWAYS_MEASURED) <= set(listed) or not set(listed) <= set(ENGINES):
        raise ValueError(f"learning-curve point: setting.engines must list {', '.join(ALWAYS_MEASURED)} and only "
                         f"engines of {', '.join(ENGINES)}")
    for engine in listed:
        for name in (*PROMPT_SETS, "all"):
            a = p["tau"].get(engine, {}).get(name)
            if not isinstance(a, dict) or not (a.get("tau") is None or a["tau"] >= 1.0) or "verify_steps" not in a:
                raise ValueError(f"learning-curve point: tau.{engine}.{name} missing or not a tau >= 1")
    return p


def append_point(point: dict, path: str | os.PathLike = CURVE_FILE) -> Path:
    path = Path(path)
    line = json.dumps(validate_point(point)) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(line)
    return path


def read_curve(path: str | os.PathLike = CURVE_FILE) -> list[dict]:
    """Every point of the curve file, in order (validated); [] when there is none."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(validate_point(json.loads(line)))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    return out


def run_point(draft: str, label: str | None = None, *, target: str = "smollm2-135m-instruct",
              curve: str | os.PathLike = CURVE_FILE, heldout_path: str | os.PathLike = HELDOUT_SET) -> dict:
    """Measure the drafter at `draft` and append its point. `draft` is a drafter directory or a
    training state directory (train/state.py: its drafter, with its token positions, data and settings)."""
    from eagle_jax.convert.drafter_formats import load_drafter
    from eagle_jax.convert.registry import load_target
    from eagle_jax.runtime import enable_compilation_cache
    from eagle_jax.train import state as state_lib

    enable_compilation_cache()
    heldout = read_heldout_set(heldout_path)
    lt = load_target(target, dtype="float32")
    if state_lib.is_state_dir(draft):
        st = state_lib.read_state(draft)
        path, training = st["drafter"], state_lib.training_record(st)
    else:
        path = draft
        training = {"token_positions": None, "token_positions_source": "not recorded (a drafter without a "
                    "training state)", "data": None, "settings": None}
    bundle = load_drafter(path, lt.cfg)
    variant = "eagle3.1" if bundle[0].is_eagle31 else "eagle3"
    measured = measure(lt.cfg, lt.params, lt.tokenizer, bundle, heldout)
    point = make_point(label or os.path.basename(os.path.normpath(draft)), os.path.relpath(path), variant,
                       training, measured, heldout)
    append_point(point, curve)
    return point


def summary_line(p: dict) -> str:
    tau = ", ".join(f"{e} {p['tau'][e]['all']['tau']:.3f}" for e in ENGINES
                    if e in p["tau"] and p["tau"][e]["all"]["tau"])
    return (f"{p['label']} ({p['variant']}): teacher-forced strict {p['teacher_forced']['strict']}; "
            f"tau (all prompts) {tau}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_jax.benchmarks.learning_curve",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", help="drafter directory or training state directory (train/state/<variant>)")
    p.add_argument("--label", help="name of the point (default: the directory name)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--output", default=CURVE_FILE, help="curve file (JSONL) appended to")
    p.add_argument("--make-heldout", action="store_true", help="write the fixed held-out set (once)")
    args = p.parse_args(argv)
    if args.make_heldout:
        from eagle_jax.generate import Generator
        from eagle_jax.runtime import enable_compilation_cache

        enable_compilation_cache()
        gen = Generator.load(args.target, draft=None, dtype="float32")
        print(write_heldout_set(make_heldout_set(gen)))
        return 0
    if not args.draft:
        p.error("--draft is required (or --make-heldout)")
    point = run_point(args.draft, args.label, target=args.target, curve=args.output)
    print(summary_line(point))
    return 0


if __name__ == "__main__":
    sys.exit(main())
