"""Shared setup of the parity suite: JAX's environment before JAX is imported (at conftest
import time, as ``tests/reference/conftest.py`` does), both sides in true fp32, and the
PARITY_REPORT summary.
"""

from __future__ import annotations

import os

from tests.support.jax_env import configure_jax

configure_jax()

import jax  # noqa: E402
import torch  # noqa: E402

# Parity is about semantics, not the last bit: both sides in true fp32 (no TF32 anywhere).
jax.config.update("jax_default_matmul_precision", "highest")
torch.backends.cuda.matmul.allow_tf32 = False


def pytest_terminal_summary(terminalreporter):
    """With PARITY_REPORT=1: the worst error each check measured, beside its tolerance."""
    if os.environ.get("PARITY_REPORT") != "1":
        return
    from tests.support.compare import MEASURED

    terminalreporter.section("parity: worst measured error per check")
    for name, (worst, tol) in sorted(MEASURED.items()):
        terminalreporter.write_line(f"{name:<40} {worst:10.2e}  (tolerance {tol:.1e})")
