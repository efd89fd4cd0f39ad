"""`python -m eagle_jax.benchmarks.report [--results-dir DIR] [--docs PATH]`: re-render docs/benchmarks.md."""

from __future__ import annotations

import argparse
import sys

from eagle_jax.benchmarks import report

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=report.__doc__)
    ap.add_argument("--results-dir", default=None)
    ap.add_argument("--docs", default=None)
    a = ap.parse_args()
    print(report.render(a.results_dir, a.docs))
    sys.exit(0)
