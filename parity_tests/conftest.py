"""Shared setup of the parity suite: JAX flags before JAX is imported, reusable fixtures.

XLA_FLAGS and JAX_DISABLE_MOST_OPTIMIZATIONS must be set before JAX is first imported, so this
runs at conftest import time (as ``tests/reference/conftest.py`` does).
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=4".strip()
# Tiny programs: XLA's CPU compile time dominates, and this cuts it 3-5x. Numerics stay IEEE
# (no fast-math); set JAX_DISABLE_MOST_OPTIMIZATIONS=0 to override.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import torch  # noqa: E402

# Parity is about semantics, not the last bit: both sides in true fp32 (no TF32 anywhere).
jax.config.update("jax_default_matmul_precision", "highest")
torch.backends.cuda.matmul.allow_tf32 = False


def pytest_terminal_summary(terminalreporter):
    """With PARITY_REPORT=1: the worst error each check measured, beside its tolerance."""
    if os.environ.get("PARITY_REPORT") != "1":
        return
    from parity_tests.compare import MEASURED

    terminalreporter.section("parity: worst measured error per check")
    for name, (worst, tol) in sorted(MEASURED.items()):
        terminalreporter.write_line(f"{name:<40} {worst:10.2e}  (tolerance {tol:.1e})")
