"""Shared setup for the reference suite: forced host devices and the suite's tolerances.

XLA_FLAGS must be set before JAX is first imported, so this runs at conftest import time.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=4".strip()
# The suite's programs are tiny: XLA's CPU compile time dominates (3-5x less with this).
# Numerics stay IEEE (no fast-math); set JAX_DISABLE_MOST_OPTIMIZATIONS=0 to override.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import pytest  # noqa: E402

# The suite's tolerances, one place, per dtype: (rtol, atol).
TOLERANCES = {
    "float32": (1e-5, 1e-6),  # same math, different association (sharded vs twin, loops)
    "float64": (1e-9, 1e-12),
    "bfloat16": (5e-2, 5e-2),  # bf16 compute vs fp32 compute
    "finite_difference": (1e-5, 1e-8),  # central differences in float64
}


@pytest.fixture
def tol():
    """``tol(dtype_name) -> dict(rtol=..., atol=...)`` for ``np.testing.assert_allclose``."""
    def get(name: str) -> dict:
        rtol, atol = TOLERANCES[name]
        return {"rtol": rtol, "atol": atol}
    return get
