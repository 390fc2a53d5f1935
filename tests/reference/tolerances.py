"""The reference suite's tolerances, in one place, per dtype: ``(rtol, atol)`` for
``np.testing.assert_allclose`` (the ``tol`` fixture in conftest.py hands them out)."""

from __future__ import annotations

TOLERANCES = {
    "float32": (1e-5, 1e-6),  # same math, different association (sharded vs twin, loops)
    "float64": (1e-9, 1e-12),
    "bfloat16": (5e-2, 5e-2),  # bf16 compute vs fp32 compute
    "finite_difference": (1e-5, 1e-8),  # central differences in float64
}
