"""The library's shape: no function over 50 lines and no file over 400 lines under torch_impl/
or reference/, measured on the syntax tree (``oversized``: a function from its ``def`` to its
end). The project's style asks for functions mostly under 30 lines and files under ~400; these
are its hard caps."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("torch_impl", "reference")
MAX_FUNCTION_LINES = 50
MAX_FILE_LINES = 400

def oversized(root: Path = ROOT) -> dict[str, int]:
    """``{"path": lines}`` of long files and ``{"path:line name": lines}`` of long functions
    (methods and nested functions included; a function's lines run from ``def`` to its end)."""
    found = {}
    for path in sorted(p for top in LIBRARY for p in (root / top).rglob("*.py")):
        name, source = path.relative_to(root).as_posix(), path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            found[name] = len(source.splitlines())
        for node in ast.walk(ast.parse(source, filename=name)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found[f"{name}:{node.lineno} {node.name}"] = lines
    return found


def test_no_library_function_or_file_is_over_the_limits():
    over = oversized()
    assert not over, (f"over {MAX_FUNCTION_LINES} lines per function / {MAX_FILE_LINES} per "
                      f"file: {over}")


def test_the_check_sees_a_long_function_and_a_long_file(tmp_path):
    lib = tmp_path / "torch_impl"
    lib.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (lib / "long.py").write_text(f"def f():\n{body}\n" + "\n" * MAX_FILE_LINES)
    (lib / "ok.py").write_text(f"def g():\n{body[:body.rindex(chr(10))]}\n")
    assert oversized(tmp_path) == {"torch_impl/long.py": MAX_FUNCTION_LINES + 1 + MAX_FILE_LINES,
                           "torch_impl/long.py:1 f": MAX_FUNCTION_LINES + 1}
