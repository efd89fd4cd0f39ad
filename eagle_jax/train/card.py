"""What a run leaves to read: its log (`read_log`), the plot of its curves (`plot_curves`) and
its model card (`model_card`).

Outputs in ``output_dir``: ``train_log.jsonl`` (one JSON object per logged
step and per evaluation), ``training_curves.png``, ``drafter/`` (speculators
format, ``save_drafter``) and ``model_card.md`` (also copied into ``drafter/``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from eagle_jax.config import DrafterConfig
from eagle_jax.runtime import machine_info
from eagle_jax.train.config import TrainConfig
from eagle_jax.train.initialize import init_source

__all__ = ["read_log", "plot_curves", "model_card"]


def _seconds(x) -> str:
    return f"{x:.1f} s" if x is not None else "not measured in this process"


def read_log(path: str | os.PathLike) -> list[dict]:
    out = []
    p = Path(path)
    if not p.is_file():
        return out
    for line in p.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill
                pass
    return out


def plot_curves(log_path, png_path) -> None:
    """Loss, per-step accuracy and tau against the step, from train_log.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_log(log_path)
    train = {r["step"]: r for r in recs if r.get("type") == "train"}  # last record per step wins
    evals = {r["step"]: r for r in recs if r.get("type") == "eval"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = sorted(train)
    if steps:
        loss = np.array([train[s]["loss"] for s in steps])
        axes[0].plot(steps, loss, lw=0.6, alpha=0.4, label="loss")
        w = max(1, len(steps) // 50)
        if w > 1:
            sm = np.convolve(loss, np.ones(w) / w, mode="valid")
            axes[0].plot(steps[w - 1:], sm, label=f"loss (mean of {w})")
        acc = np.array([train[s]["acc_i"] for s in steps])
        for i in range(acc.shape[1]):
            a = acc[:, i]
            if w > 1:
                a = np.convolve(a, np.ones(w) / w, mode="valid")
            axes[1].plot(steps[len(steps) - len(a):], a, label=f"step {i}")
    axes[0].set_title("TTT loss")
    axes[0].set_xlabel("step")
    axes[1].set_title("top-1 accuracy per TTT step")
    axes[1].set_xlabel("step")
    if steps:
        axes[0].legend()
        axes[1].legend()
    es = sorted(s for s in evals if evals[s].get("tau") is not None)
    if es:
        axes[2].plot(es, [evals[s]["tau"] for s in es], "o-", label="tau (greedy chain)")
        axes[2].legend()
    axes[2].set_title("acceptance length")
    axes[2].set_xlabel("step")
    fig.tight_layout()
    from eagle_jax.benchmarks.report.common import save_png

    save_png(fig, png_path, dpi=100)
    plt.close(fig)


def model_card(cfg: TrainConfig, d: DrafterConfig, summary: dict, data_info: dict, log_path, *, widened: bool,
               widened_mlp_from: int | None) -> str:
    """The run's model_card.md: measured acceptance, data, training, drafter, full config."""
    mi = machine_info()
    ev, ev0 = summary.get("eval"), summary.get("start_eval")
    last = summary.get("last") or {}

    def fmt_eval(e):
        if not e or e.get("tau") is None:
            return "not measured"
        pp = ", ".join(f"{x:.3f}" for x in e["per_position"])
        return (f"tau {e['tau']:.3f} (greedy chain k={e['k']}, {e['prompts']} held-out prompts, "
                f"{e['max_new_tokens']} new tokens each; per-position acceptance [{pp}])")

    lines = [
        f"# EAGLE drafter for {d.verifier_name_or_path or cfg.target}",
        "",
        f"Variant **{cfg.variant}** ({'fc_norm + norm_output' if d.is_eagle31 else 'EAGLE-3: fc, pre-norm feedback'}), "
        f"trained with eagle-jax's training-time test ({cfg.ttt_length} steps, step weights "
        f"{cfg.step_decay}**i, {cfg.labels} labels).",
        "",
        "## Measured acceptance",
        f"- trained: {fmt_eval(ev)}",
        f"- untrained (step 0): {fmt_eval(ev0)}",
        "",
        "## Data",
        f"- source: {cfg.data}; max conversations {cfg.max_conversations}; held-out fraction "
        f"{cfg.heldout_fraction}",
    ]
    for k, v in data_info.items():
        lines.append(f"- {k}: {v}")
    lines += [
        "",
        "## Training",
        f"- steps: {summary['step']} x batch {cfg.batch_size} x seq_len {cfg.seq_len} "
        f"(buckets {cfg.bucket_lengths or 'none'})",
        f"- final loss {last.get('loss', float('nan')):.4f}; per-step top-1 accuracy "
        f"{[round(a, 3) for a in last.get('acc_i', [])]} (last batch)",
        f"- optimiser: AdamW lr {cfg.lr} (warmup {cfg.warmup_steps}, cosine to "
        f"{cfg.lr * cfg.min_lr_ratio:g}), betas ({cfg.beta1}, {cfg.beta2}), weight decay "
        f"{cfg.weight_decay}, grad clip {cfg.grad_clip}",
        f"- compute dtype {cfg.dtype} (target pass {cfg.target_dtype or cfg.dtype}), parameter dtype "
        f"{cfg.param_dtype}, seed {cfg.seed}",
        f"- wall time: {summary['wall_s'] / 3600:.2f} h ({summary['wall_s']:.0f} s); "
        f"first step incl. compile {_seconds(summary.get('compile_s'))}; "
        f"throughput {last.get('tok_s', float('nan')):.0f} tokens/s at the last step (padded); "
        f"{summary['step'] * cfg.batch_size * cfg.seq_len / max(last.get('elapsed_s') or 0, 1e-9):.0f} "
        f"tokens/s over the run",
        f"- machine: {mi['description']}, jax {mi['jax']}",
    ]
    for r in read_log(log_path):
        if r.get("type") == "resume":
            what = "; ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in r["changed"].items())
            lines.append(f"- resumed at step {r['step']}" + (f", changed: {what}" if what else ""))
    lines += [
        "",
        "## Drafter",
        f"- hidden {d.hidden_size}, heads {d.num_heads}/{d.num_kv_heads} (head_dim {d.head_dim}), "
        f"FFN {d.intermediate_size}, draft vocab {d.draft_vocab_size} of {d.vocab_size}",
        f"- aux layers (input of target layer i) {list(d.aux_layer_ids)}",
        (f"- init: the drafter at {init_source(cfg)} (its weights and draft vocabulary"
         + (f", from the training state {cfg.resume_from}" if cfg.resume_from else "")
         + (f"; vocabulary widened to {d.draft_vocab_size}, the added ids' head columns mapped from the "
            "target's"
            if widened else "")
         + (f"; MLP widened from {widened_mlp_from} to {d.intermediate_size} units, the new units' "
            "down-projection rows zero" if widened_mlp_from else "") + "); "
         if init_source(cfg) else
         f"- init: random, lm_head = target lm_head rows of the draft vocab, norm = target final norm; ")
        + "embedding shared from the target (not exported)",
        f"- export: {cfg.export_format} format, {cfg.export_dtype or cfg.param_dtype}",
        "",
        "## Full config",
        "```json",
        json.dumps(cfg.to_dict(), indent=2),
        "```",
        "",
    ]
    return "\n".join(lines)
