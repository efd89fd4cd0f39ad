"""What every section shares: loading the result files, table formatting, and saving figures.

Loading: the newest result per (suite, mode, machine). Formatting: cells, markdown tables and
the caption under every table. Figures: matplotlib on Agg, line charts and palette PNGs
written next to their result file (train/card.py's curves use `save_png` too).
"""

from __future__ import annotations

import glob
import gzip
import json
import os

from eagle_jax.benchmarks.harness import machine_slug
from eagle_jax.runtime import describe_machine

# ----------------------------------------------------------------------------- loading


RESULT_SUFFIXES = (".json.gz", ".json")  # older results are committed gzipped


def result_stem(path: str) -> str:
    """A result file's path without its suffix (the prefix of its PNGs)."""
    return next(path[: -len(s)] for s in RESULT_SUFFIXES + ("",) if path.endswith(s))


def load_results(results_dir: str) -> list[dict]:
    out = []
    paths = sorted(p for s in RESULT_SUFFIXES for p in glob.glob(os.path.join(results_dir, "*" + s)))
    for path in paths:
        try:
            with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
                r = json.load(f)
        except (OSError, EOFError, json.JSONDecodeError):
            continue
        if not isinstance(r, dict) or "suite" not in r or "machine" not in r:
            continue
        r["_path"] = path
        out.append(r)
    return out


def newest(results: list[dict]) -> tuple[list[dict], list[dict]]:
    """(newest per (suite, mode, machine), the rest)."""
    best: dict = {}
    for r in results:
        key = (r["suite"], r.get("mode"), machine_slug(r["machine"]))
        if key not in best or (r.get("date", ""), r["_path"]) > (best[key].get("date", ""), best[key]["_path"]):
            best[key] = r
    chosen = sorted(best.values(), key=lambda r: (r["suite"], r.get("mode") or "", r.get("date", "")))
    rest = [r for r in results if all(r is not c for c in chosen)]
    return chosen, rest


# ----------------------------------------------------------------------------- formatting


def fmt(x, nd=2, dash="–"):
    if x is None:
        return dash
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if x != x:
            return dash
        return f"{x:.{nd}f}"
    return str(x)


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines)


def caption(r: dict) -> str:
    m = r["machine"]
    desc = m.get("description") or describe_machine(m)
    return (f"*Command:* `{r.get('command', '?')}` — *machine:* {desc} — *date:* {r.get('date', '?')} — "
            f"*jax* {r.get('jax_version', '?')} — *file:* `{os.path.basename(r['_path'])}`")


# ----------------------------------------------------------------------------- figures


def _rel(path: str, docs_path: str) -> str:
    return os.path.relpath(path, os.path.dirname(os.path.abspath(docs_path))).replace(os.sep, "/")


def _png(r: dict, what: str) -> str:
    return f"{result_stem(r['_path'])}-{what}.png"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _line_chart(r: dict, what: str, series: dict, *, xlabel: str, ylabel: str, title: str,
                logx: bool = False, xticks=None, ylim=None, hline=None) -> str:
    """One-axis line chart of `series` {label: [(x, y), ...]} saved as this result's `what` PNG."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, pts in sorted(series.items()):
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if hline is not None:
        ax.axhline(hline, color="gray", lw=0.8, ls="--")
    if logx:
        ax.set_xscale("log", base=2)
    if xticks is not None:
        ax.set_xticks(xticks, [str(x) for x in xticks])
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(fig, r, what)


def _save(fig, r: dict, what: str) -> str:
    path = _png(r, what)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    _plt().close(fig)
    return path


def save_png(fig, path, *, dpi: int, colors: int = 64) -> None:
    """Write `fig` to `path` as a palette PNG of at most `colors` colours, atomically.

    Plots are flat colours: a 64-colour palette looks the same and takes about a
    fifth of the bytes of matplotlib's RGBA file, which matters for PNGs kept in git."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    tmp = f"{path}.tmp.png"
    Image.open(buf).convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(
        tmp, optimize=True)
    os.replace(tmp, path)
