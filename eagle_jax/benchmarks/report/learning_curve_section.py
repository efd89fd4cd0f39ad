"""The learning curve's section: every point of benchmarks/results/learning_curve.jsonl and its plot.
"""

from __future__ import annotations

from eagle_jax.benchmarks.report.common import _plt, _rel, fmt, save_png, table


def render_learning_curve(points: list[dict], png_path: str, docs_path: str) -> str:
    """Table of every learning-curve point and a plot against token positions seen."""
    from eagle_jax.benchmarks.learning_curve import ENGINES, PROMPT_SETS

    first = points[0]
    st = first["setting"]
    out = [f"Every training run adds a point (`eagle-jax train ... --learning-curve`, or `eagle-jax bench --suite "
           f"learning-curve --draft DIR`). Fixed held-out sets (`benchmarks/prompts/"
           f"{first['heldout_set']['file']}`, sha1 {first['heldout_set']['sha1']}): teacher-forced top-1 per TTT "
           f"step (strict: a target token outside the draft vocabulary is a miss) over "
           f"{len(first['heldout_set']['answers'])} held-out ShareGPT answers of the target; engine tau at "
           f"{st['dtype']}, greedy, batch {st['batch_size']}, {st['max_new_tokens']} new tokens on "
           + " + ".join(f"{len(first['heldout_set'][n])} {n}" for n in PROMPT_SETS) + " prompts.", ""]
    rows = []
    for p in points:
        tr = p["training"]
        rows.append([p["date"][:10], p["label"], p["variant"], fmt(tr["token_positions"]), fmt(tr.get("steps")),
                     " / ".join(f"{x:.3f}" for x in p["teacher_forced"]["strict"]),
                     *[" / ".join(fmt(p["tau"][e][n]["tau"]) for n in (*PROMPT_SETS, "all"))
                       if e in p["tau"] else fmt(None) for e in ENGINES],
                     p["machine"]])
    out.append(table(["date", "label", "variant", "token positions", "steps", "teacher-forced strict per TTT step",
                      *[f"tau {e} ({' / '.join((*PROMPT_SETS, 'all'))})" for e in ENGINES], "machine"], rows))
    out.append("")
    out.append("Token positions: batch rows x padded length summed over training steps; where each figure comes "
               "from is in the point's `training.token_positions_source`.")
    out.append("")
    out.append(f"![learning curve]({_rel(learning_curve_figure(points, png_path), docs_path)})")
    return "\n".join(out)


def learning_curve_figure(points: list[dict], png_path: str) -> str:
    """Teacher-forced step-0 accuracy and pooled tau against token positions, one line per variant."""
    from eagle_jax.benchmarks.learning_curve import ENGINES

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for variant in sorted({p["variant"] for p in points}):
        pts = sorted((p["training"]["token_positions"], p) for p in points
                     if p["variant"] == variant and p["training"]["token_positions"] is not None)
        xs = [x for x, _ in pts]
        axes[0].plot(xs, [p["teacher_forced"]["strict"][0] for _, p in pts], marker="o", label=variant)
        for e in ENGINES:
            measured = [(x, p["tau"][e]["all"]["tau"]) for x, p in pts if e in p["tau"]]
            if measured:
                axes[1].plot(*zip(*measured), marker="o", label=f"{variant} {e}")
    for ax, ylabel, title in ((axes[0], "top-1 accuracy, TTT step 0", "Teacher-forced accuracy (held-out answers)"),
                              (axes[1], "tau (all prompts)", "Engine tau (fp32, greedy)")):
        ax.set_xscale("log")
        ax.set_xlabel("token positions seen")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, png_path, dpi=110)
    plt.close(fig)
    return png_path
