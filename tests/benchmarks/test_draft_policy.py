"""`eagle-jax bench --suite draft-policy` end to end on the real target and bundled drafter (slow:
five engines compile and warm up)."""

from __future__ import annotations

import argparse
import json

import pytest

from eagle_jax.benchmarks import cli


@pytest.mark.slow
def test_every_engine_answers_as_plain_and_counts_its_steps(tmp_path):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--suite", "draft-policy", "--serve-concurrency", "1,2", "--max-new-tokens", "8",
                              "--rounds", "1", "--output-dir", str(tmp_path), "--no-report"])
    assert cli.main(args) == 0
    (path,) = tmp_path.glob("draft_policy-engines-*.json")
    result = json.loads(path.read_text())
    deepest = result["settings"]["deepest"]
    assert f"1x{deepest}" in result["adaptive_step_ms"] and "2x0" in result["adaptive_step_ms"]
    for c, level in result["levels"].items():
        assert list(level)[:2] == ["plain", "adaptive"] and f"depth {deepest}" in level
        for name, e in level.items():
            assert e["replies"] == int(c) and e["same_texts_as_plain"] == e["replies"], (c, name)  # greedy
            assert e["per_user_tokens_per_s"] > 0
        assert set(level["plain"]["steps_by_depth"]) == {"0"} and level["plain"]["catch_ups"] == 0
        for d in range(1, deepest + 1):
            if f"depth {d}" in level:  # a fixed depth drafts at that depth only, after catching up
                assert set(level[f"depth {d}"]["steps_by_depth"]) == {str(d)}
                assert level[f"depth {d}"]["catch_ups"] > 0
