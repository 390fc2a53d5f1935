"""``python -m benchmarks.gpu --check`` in the environments it runs in (issue 38, item 14).

Its gpu-tests step collects all of ``tests/``: in an environment without JAX (the ``dev``
extra only) ``tests/reference`` must be skipped with its reason, not stop the collection with
six errors; and ``nox -s gpu`` builds the environment the check needs and runs it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_reference_suite_without_jax_is_skipped_with_its_reason(tmp_path):
    for name in ("jax", "flax", "optax"):  # as if the reference extra were not installed
        (tmp_path / f"{name}.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n")
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                          "tests/reference", "-p", "no:cacheprovider"], cwd=REPO,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    out = res.stdout + res.stderr
    assert res.returncode in (0, 5), out[-3000:]  # 5: nothing collected
    assert "ERROR" not in out and "Traceback" not in out, out[-3000:]
    assert "tests/reference not collected: No module named 'jax'" in out, out[-3000:]


def test_nox_has_a_gpu_session_that_installs_the_checks_needs_and_runs_it():
    tree = ast.parse((REPO / "noxfile.py").read_text())
    session = next((f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "gpu"),
                   None)
    assert session is not None, "noxfile.py has no gpu session"
    text = ast.unparse(session)
    assert "_install(session, 'dev,reference,data')" in text, text
    assert "'benchmarks.gpu', '--check'" in text, text
