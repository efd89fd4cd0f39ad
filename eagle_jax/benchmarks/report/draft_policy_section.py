"""The draft_policy suite's section: engines without HTTP, the draft policy against fixed depths.
"""

from __future__ import annotations

from eagle_jax.benchmarks.report.common import caption, fmt


def render_draft_policy(r: dict) -> str:
    """benchmarks/draft_policy.py: engines without HTTP, the draft policy against fixed depths."""
    st = r.get("settings", {})
    engines = list(next(iter(r.get("levels", {}).values()), {}))
    out = [f"### The draft policy against fixed depths ({r.get('date', '?')[:10]})", "", caption(r), "",
           f"Engines in one process ({st.get('slots')} rows, max_len {st.get('max_len')}), no HTTP: plain, "
           f"`adaptive` (the depth of each step picked by the policy, as `eagle-jax serve` runs) and each fixed "
           f"draft depth, drafter {st.get('draft')}; at concurrency c, c greedy HumanEval chats submitted at once, "
           f"{st.get('max_new_tokens')} new tokens each; a user's throughput is its tokens over its request's "
           f"wall time; {st.get('rounds')} timed rounds, engines in a rotated order. Cells: per-user tok/s "
           f"(ratio to plain, paired by round); steps by draft depth (0: plain) and catch-up calls below.", "",
           "| concurrency | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
    for c, level in r.get("levels", {}).items():
        out.append(f"| {c} | " + " | ".join(f"{fmt(e['per_user_tokens_per_s'], 1)} ({fmt(e['vs_plain_paired_median'])})"
                                          for e in level.values()) + " |")
        out.append("| steps | " + " | ".join(
            ", ".join(f"{d}: {k}" for d, k in e["steps_by_depth"].items()) + f"; {e['catch_ups']} catch-ups"
            for e in level.values()) + " |")
    return "\n".join(out)
