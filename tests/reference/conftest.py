"""Shared setup for the reference suite: forced host devices (before JAX is first imported,
so at conftest import time) and the ``tol`` fixture over the suite's tolerances.

Without JAX (an environment with the ``dev`` extra only, as ``python -m benchmarks.gpu
--check`` may run in) the suite is not collected, and the run's summary says why, instead of
six collection errors that stop the whole run (issue 38, item 14).
"""

from __future__ import annotations

from tests.support.jax_env import configure_jax

configure_jax()

import pytest  # noqa: E402

try:
    import jax  # noqa: E402, F401
except ImportError as missing:
    collect_ignore_glob = ["test_*.py"]
    SKIPPED = (f"tests/reference not collected: {missing} (the JAX reference suite needs the "
               "reference extra: pip install -e '.[reference]')")
else:
    SKIPPED = None


def pytest_terminal_summary(terminalreporter) -> None:
    """The reason the suite was not collected, in the run's summary."""
    if SKIPPED is not None:
        terminalreporter.write_line(f"SKIPPED {SKIPPED}", yellow=True)

from tests.reference.tolerances import TOLERANCES  # noqa: E402


@pytest.fixture
def tol():
    """``tol(dtype_name) -> dict(rtol=..., atol=...)`` for ``np.testing.assert_allclose``."""
    def get(name: str) -> dict:
        rtol, atol = TOLERANCES[name]
        return {"rtol": rtol, "atol": atol}
    return get
