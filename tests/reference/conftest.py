"""Shared setup for the reference suite: forced host devices (before JAX is first imported,
so at conftest import time) and the ``tol`` fixture over the suite's tolerances."""

from __future__ import annotations

from tests.support.jax_env import configure_jax

configure_jax()

import pytest  # noqa: E402

from tests.reference.tolerances import TOLERANCES  # noqa: E402


@pytest.fixture
def tol():
    """``tol(dtype_name) -> dict(rtol=..., atol=...)`` for ``np.testing.assert_allclose``."""
    def get(name: str) -> dict:
        rtol, atol = TOLERANCES[name]
        return {"rtol": rtol, "atol": atol}
    return get
