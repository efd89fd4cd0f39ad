"""The collectives of compiled HLO text, for the mesh scripts (run_on_mesh.py, train_on_mesh.py)."""

from __future__ import annotations

import re

_COLLECTIVE = re.compile(r"= \(?((?:[a-z0-9]+\[[0-9,]*\][^ ]*,? ?)+)\)? (all-gather|all-reduce|reduce-scatter|"
                         r"collective-permute|all-to-all)(?:-start)?\(")


def compiled_collectives(text: str) -> dict:
    """{kind: [result shape, ...]} of each kind of collective in compiled HLO text."""
    out = {}
    for m in _COLLECTIVE.finditer(text):
        shapes = [[int(x) for x in dims.split(",") if x] for dims in re.findall(r"\[([0-9,]*)\]", m.group(1))]
        out.setdefault(m.group(2), []).extend(s for s in shapes if s not in out.get(m.group(2), []))
    return out
