"""The device check (eagle_jax/benchmarks/device_check.py) runs end to end in its CPU dry run,
so it cannot rot before a GPU or TPU is lent; and its verdict helpers say what they should."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from eagle_jax.benchmarks import device_check as dc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dry_run_end_to_end(tmp_path, capsys):
    # A budget no loaded test machine reaches (the dry run's own 120 s is for a
    # person at a terminal): this test is about every section running.
    assert dc.main(["--dry-run", "--output-dir", str(tmp_path), "--budget-s", "3600"]) == 0
    printed = capsys.readouterr().out
    assert "result: PASS" in printed
    out = json.loads((tmp_path / dc.RESULT_FILE).read_text())
    assert out["dry_run"] and not out["partial"] and out["failures"] == []
    assert out["environment"]["backend"] == "cpu"
    kernels = out["kernels"]
    assert {r["impl"] for r in kernels} == {"xla", "interpret"}
    assert all(r["ok"] for r in kernels)
    for section in ("equivalence", "speed"):
        (res,) = out[section]
        assert set(res["engines"]) == {"plain", "chain", "tree"}
        for name in ("chain", "tree"):
            e = res["engines"][name]
            assert [r["verdict"] for r in e["rows"]] == ["equal"] * 3
            assert e["decode_tokens_per_s"] > 0 and e["break_even_tau"] > 0
        # the comparison sees a changed token, and reads the target's logits there
        assert res["canary"]["caught"] and res["canary"]["plain_is_top1"]
    # the 8-token vocabulary makes random drafts hit: accepted paths are committed and compacted
    assert all(out["equivalence"][0]["engines"][n]["accepted_tokens"] > 0 for n in ("chain", "tree"))


def test_refuses_a_full_run_on_cpu():
    with pytest.raises(SystemExit, match="the backend is CPU"):
        dc.main([])


_BARE = """
import runpy, sys
def editable(f):
    return "__editable__" in (getattr(f, "__module__", "") or "") + type(f).__module__
sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
sys.path_importer_cache.clear()
sys.argv = ["device_check", "--help"]
sys.path.insert(0, ".")  # as `python -m` run from the checkout's root
try:
    runpy.run_module("eagle_jax.benchmarks.device_check", run_name="__main__")
except SystemExit:
    pass
print("kernels from", sys.modules["eagle_jax.kernels"].__file__)
"""


def test_runs_from_a_bare_checkout():
    """As on the device: the file run directly, eagle_jax not installed (the editable finder removed)."""
    r = subprocess.run([sys.executable, "-c", _BARE], cwd=ROOT, env={**os.environ, "PYTHONPATH": ""},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--dry-run" in r.stdout
    assert f"kernels from {os.path.join(ROOT, 'eagle_jax', 'kernels', '__init__.py')}" in r.stdout


def test_first_divergence():
    assert dc.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert dc.first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert dc.first_divergence([1, 2], [1, 2, 3]) == 2


def test_classify_divergence_near_tie_and_mismatch():
    logits = np.array([0.0, 3.0, 2.95, 1.0])
    near = dc.classify_divergence(logits, plain_tok=1, spec_tok=2, tie_gap=0.1)
    assert near["verdict"] == "near-tie" and near["top2_ids"] == [1, 2]
    assert near["top2_gap"] == pytest.approx(0.05) and near["logit_gap_between"] == pytest.approx(0.05)
    # the teacher-forced top-1 may be either engine's token: the gap between the two decides
    assert dc.classify_divergence(logits, plain_tok=2, spec_tok=1, tie_gap=0.1)["verdict"] == "near-tie"
    assert dc.classify_divergence(logits, plain_tok=1, spec_tok=3, tie_gap=0.1)["verdict"] == "MISMATCH"
    assert dc.classify_divergence(logits, plain_tok=1, spec_tok=None, tie_gap=0.1)["verdict"] == "MISMATCH"


def test_reference_f64_segments():
    rng = np.random.default_rng(0)
    x, g, w = rng.normal(size=(2, 6)), rng.normal(size=6), rng.normal(size=(6, 4))
    one = dc.reference_f64(x[:, :3], g[:3], w[:3], eps=1e-6, segments=1)
    two = dc.reference_f64(x[:, 3:], g[3:], w[3:], eps=1e-6, segments=1)
    assert np.allclose(dc.reference_f64(x, g, w, eps=1e-6, segments=2), one + two)


def test_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        dc.make_settings(True, dtype="float16")


def test_bench_suite_device_reaches_the_check():
    import argparse

    from eagle_jax.benchmarks import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit, match="the backend is CPU"):
        cli.main(parser.parse_args(["--suite", "device"]))


def test_gpu_settings_leave_out_what_the_mosaic_gpu_kernel_refuses(monkeypatch):
    """On a GPU: bfloat16 kernel rows only, no Pallas loop on the 8-token equivalence target,
    and no Pallas loop at all in float32 (the kernel takes 16-bit dtypes)."""
    monkeypatch.setattr(dc.jax, "default_backend", lambda: "gpu")
    s = dc.make_settings(False)
    assert s.kernel_dtypes == ("bfloat16",) and s.loop_impls == ("xla", "pallas") and s.eq_impls == ("xla",)
    assert dc.make_settings(False, dtype="float32").loop_impls == ("xla",)
    monkeypatch.setattr(dc.jax, "default_backend", lambda: "tpu")
    s = dc.make_settings(False)
    assert s.kernel_dtypes == ("float32", "bfloat16") and s.eq_impls == s.loop_impls == ("xla", "pallas")
