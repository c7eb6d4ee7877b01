"""The package's import graph has no cycle, function-level imports included: each module's dependencies can be
read (and moved) without finding the module itself at the other end."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "eagle3"


def _graph() -> dict[str, set[str]]:
    mods = {".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PKG.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        package = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            edges[m] |= {n for n in names if n in mods and n != m}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    edges = _graph()
    assert len(edges) > 40 and "eagle3.loss" in edges["eagle3.trainer"]  # the whole package, edges read
    assert _cycles(edges) == []


def test_the_detector_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


MAX_FUNCTION_LINES = 60
"""A function a reader takes in at once; longer ones are split into named steps (issues 25, 42)."""


def _long_functions(source: str, where: str) -> list[str]:
    return [f"{where}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_in_the_package_is_over_60_lines():
    found = [f for p in sorted(PKG.rglob("*.py")) for f in _long_functions(p.read_text(), str(p.relative_to(PKG)))]
    assert found == []


def test_the_length_guard_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(f"def f():\n{body}\n", "m.py") == [f"m.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert _long_functions("def g():\n    return 1\n", "m.py") == []


MAX_MODULE_LINES = 600
"""A module a maintainer reads as one concern (issue 42); a longer one holds two."""


def test_no_module_in_the_package_is_over_600_lines():
    found = {str(p.relative_to(PKG)): n for p in sorted(PKG.rglob("*.py"))
             if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert found == {}


STAGE_ENTRIES = {"prepare.py:run", "extract.py:run", "extract.py:plan", "trainer.py:run", "trainer.py:set_up",
                 "evaluate.py:run", "regenerate/__init__.py:run", "verify_extraction.py:run", "coverage.py:run",
                 "data/show.py:show"}
"""The functions that take the root Config (issue 42): each stage's entry and its set-up; everything they call takes
its section and the run's paths (eagle3.paths.RunPaths)."""


def _take_root_config(source: str, where: str) -> list[str]:
    return [f"{where}:{n.name}" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and any(a.annotation is not None and ast.unparse(a.annotation) in ("Config", "Config | None")
                    for a in [*n.args.posonlyargs, *n.args.args, *n.args.kwonlyargs])]


def test_only_the_stage_entries_take_the_root_config():
    found = {f for p in sorted(PKG.rglob("*.py")) for f in _take_root_config(p.read_text(), str(p.relative_to(PKG)))}
    assert found == STAGE_ENTRIES and len(found) <= 10


def test_the_config_guard_sees_a_helper_taking_the_root_config():
    assert _take_root_config("def f(cfg: Config, n: int): ...\ndef g(t: TargetConfig): ...", "m.py") == ["m.py:f"]
