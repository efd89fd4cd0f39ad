"""The layout's rules, read from the source with `ast` (docs/ARCHITECTURE.md):

* every import between eagle_jax's modules, function-local ones included, forms no cycle;
* the core (everything but `serve`, `train`, `benchmarks` and the CLI) imports none of those;
* kernel dispatch has one place: outside `eagle_jax.kernels` nothing imports the native kernels
  (`kernels.cpu`) or resolves an impl (`resolve_impl`); they go through `kernels.ops` (the native
  kernels' own A/B benchmark, `benchmarks/native/`, excepted);
* no top-level folder of the checkout but eagle_jax is a Python package (none can shadow an
  installed one when the checkout's root is on sys.path).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "eagle_jax"
OUTER = ("eagle_jax.serve", "eagle_jax.train", "eagle_jax.benchmarks", "eagle_jax.cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The eagle_jax modules `name` (at `path`) imports, anywhere in its body: a
    `from X import y` counts as X.y where that is a module, else X; a module's name
    passed to a call (importlib.import_module) counts too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
        elif isinstance(node, ast.Call):  # importlib.import_module("eagle_jax.x") and the like
            found |= {a.value for a in node.args if isinstance(a, ast.Constant) and a.value in known}
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, name, set(mods)) for name, path in mods.items()}


def cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of g, or None (a depth-first search; a package's __init__ importing
    its own submodules is how a package exposes them, so package -> child edges are left out)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g[m]):
            if n.startswith(m + "."):
                continue
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
    assert cycle(graph()) is None, " -> ".join(cycle(graph()))


def test_the_core_imports_nothing_above_it():
    outer = lambda m: any(m == o or m.startswith(o + ".") for o in OUTER)
    bad = sorted((m, n) for m, deps in graph().items() if not outer(m) for n in deps if outer(n))
    assert not bad, bad


def test_no_top_level_folder_but_eagle_jax_is_a_package():
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert packages == ["eagle_jax"], packages


def test_kernel_dispatch_lives_in_the_op_facade():
    inside = lambda m: m == "eagle_jax.kernels" or m.startswith(("eagle_jax.kernels.", "eagle_jax.benchmarks.native"))
    mods = modules()
    bad = sorted((m, n) for m, deps in graph().items() if not inside(m) for n in deps
                 if n == "eagle_jax.kernels.cpu")
    for m, path in mods.items():
        if inside(m):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Name) and node.id == "resolve_impl" or \
                    isinstance(node, ast.Attribute) and node.attr == "resolve_impl":
                bad.append((m, "resolve_impl"))
    assert not bad, bad
