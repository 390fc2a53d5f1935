"""The plan and its tests import neither JAX nor torch (the production install has no JAX;
the plan is the part both sides share)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def test_the_plan_and_its_tests_import_without_jax_or_torch():
    modules = [f"tests.plan.{p.stem}" for p in sorted(HERE.glob("*.py")) if p.stem != "__init__"]
    code = ("import importlib, sys\n"
            "sys.modules.update(dict.fromkeys(('jax', 'torch', 'flax', 'optax')))\n"
            f"for name in {['moezero.plan.store', *modules]!r}:\n"
            "    importlib.import_module(name)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1:]
