"""benchmarks/ modules point one way: no import cycle among them, counting the imports inside
functions too (a cycle held together by a function-level import is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def imports_of(source: str) -> set[str]:
    """The ``benchmarks`` modules a module's source imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
    return found


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module -> modules it imports) as a path, or []."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return []


def test_benchmark_modules_have_no_import_cycle():
    graph = {p.stem: imports_of(p.read_text()) for p in BENCH.glob("*.py")}
    assert not cycle(graph), " -> ".join(cycle(graph))


def test_the_check_sees_a_cycle_through_a_function_level_import():
    a = imports_of("from benchmarks import b\n")
    b = imports_of("def f():\n    from benchmarks.c import x\n")
    c = imports_of("import benchmarks.a\n")
    assert cycle({"a": a, "b": b, "c": c}) == ["a", "b", "c", "a"]
    assert cycle({"a": a, "b": b, "c": set()}) == []
