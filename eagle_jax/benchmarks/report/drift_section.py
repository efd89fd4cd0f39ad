"""The drift suite's section: attention-drift diagnostics by drafter and context, with their figures.
"""

from __future__ import annotations

from eagle_jax.benchmarks.drift import PROMPT_FORMATS
from eagle_jax.benchmarks.report.common import _line_chart, _plt, _rel, _save, caption, fmt, table


def render_drift(r: dict, docs_path: str) -> str:
    out = [f"### Attention-drift diagnostics, `{r.get('mode')}` run ({r.get('date', '?')[:10]})", "", caption(r), ""]
    if any(d.get("random_init") for d in r.get("drafters", [])):
        out.append("> **Random-init drafters** (UNTRAINED) are shown to prove the diagnostic runs; their "
                   "numbers describe random weights, not EAGLE-3 or EAGLE 3.1.")
        out.append("")
    for n in r.get("notes", []):
        out.append(f"- {n}")
    s = r.get("settings", {})
    out.append(f"- chain depth {s.get('depth')}; sink = first {s.get('sink_tokens')} positions; prompt "
               f"queries from position {s.get('prompt_query_min_pos')} on; tau from a {s.get('max_new_tokens')}"
               f"-token greedy chain generation")
    out.append("")
    rows = []
    for g in r.get("summary", []):
        rows.append([g["label"], g["context"], g.get("format", "template"), fmt(g["prompt_tokens_mean"], 0),
                     g["num_prompts"],
                     fmt(g["tau"]), " ".join(f"{x:.2f}" for x in g["per_position_acceptance"]) or "–",
                     fmt(g["feature_rms_prompt"]),
                     " ".join(f"{x:.2f}" for x in g["hidden_rms_by_depth"]),
                     fmt(g["sink_mass_prompt"], 3),
                     " ".join(f"{x:.3f}" for x in g["sink_mass_by_depth"]),
                     fmt(g["root_accepted_mean"])])
    if rows:
        out.append(caption(r))
        out.append("")
        out.append(table(["drafter", "context", "format", "prompt tok", "n", "tau", "per-position acc.",
                          "feature RMS (prompt)", "hidden RMS by depth", "sink share (prompt)",
                          "sink share by depth", "chain accepted at root"], rows))
        out.append("")
    for title, path in drift_figures(r):
        out.append(f"![{title}]({_rel(path, docs_path)})")
        out.append("")
    return "\n".join(out)


def drift_figures(r: dict) -> list[tuple[str, str]]:
    summary = r.get("summary") or []
    if not summary:
        return []
    plt = _plt()
    figs = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for g in summary:
        lab = f"{g['drafter']} ({g['context']})"
        d = range(1, len(g["hidden_rms_by_depth"]) + 1)
        axes[0].plot(d, g["hidden_rms_by_depth"], marker="o", label=lab)
        axes[1].plot(d, g["sink_mass_by_depth"], marker="o", label=lab)
    depth = max((len(g["hidden_rms_by_depth"]) for g in summary), default=1)
    for ax in axes:
        ax.set_xticks(range(1, depth + 1))
    axes[0].set_xlabel("chain depth")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("RMS of hidden input (log)")
    axes[0].set_title("Hidden-state norm by depth")
    axes[1].set_xlabel("chain depth")
    axes[1].set_ylabel("attention share on first 4 tokens")
    axes[1].set_title("Sink attention by depth")
    axes[0].legend(fontsize=6)
    figs.append(("hidden-state norm and sink attention by depth", _save(fig, r, "hidden-norm")))
    by_drafter: dict = {}
    template = [g for g in summary if g.get("format", "template") == "template"]
    for g in template:
        if g["context"] != "short" and g["tau"] is not None:
            by_drafter.setdefault(g["drafter"], []).append((g["prompt_tokens_mean"], g["tau"]))
    shorts = {g["drafter"]: (g["prompt_tokens_mean"], g["tau"]) for g in template
              if g["context"] == "short" and g["tau"] is not None}
    if by_drafter or shorts:
        lines = {dr: by_drafter.get(dr, []) + ([shorts[dr]] if dr in shorts else [])
                 for dr in set(by_drafter) | set(shorts)}
        figs.append(("tau by context length", _line_chart(
            r, "drift-tau", lines, xlabel="prompt tokens", ylabel="tau",
            title="tau by context length (chain, greedy)", logx=True)))
    by_depth = {f"{g['drafter']} ({g['context']}, {g.get('format', 'template')})":
                list(enumerate(g["tau_by_depth"], start=1)) for g in summary if g.get("tau_by_depth")}
    if by_depth:
        figs.append(("acceptance length by chain depth", _line_chart(
            r, "drift-tau-depth", by_depth, xlabel="chain depth k", ylabel="tau (1 + accepted)",
            title="acceptance length by chain depth (greedy)")))
    formats = {g.get("format", "template") for g in summary}
    if len(formats) > 1:
        lines: dict = {}
        order = sorted(formats, key=lambda f: PROMPT_FORMATS.index(f) if f in PROMPT_FORMATS else 99)
        for g in summary:
            if g["context"] == "short" and g["tau"] is not None:
                lines.setdefault(g["drafter"], []).append((order.index(g.get("format", "template")), g["tau"]))
        figs.append(("tau by prompt format", _line_chart(
            r, "drift-tau-format", lines, xlabel="prompt format: " + ", ".join(
                f"{i} {f}" for i, f in enumerate(order)), ylabel="tau", title="tau by prompt format (short prompts)")))
    return figs
