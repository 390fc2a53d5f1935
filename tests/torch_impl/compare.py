"""Tolerances (per dtype) and FQN-keyed comparison helpers for the torch-side tests."""

from __future__ import annotations

import numpy as np

# Relative tolerances: ||a - b|| / ||b|| per tensor, and |a - b| / |b| for scalars.
RTOL = {"fp32": 1e-5}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    denom = np.linalg.norm(b.ravel())
    return float(np.linalg.norm((a - b).ravel()) / (denom if denom > 0 else 1.0))


def assert_close_by_fqn(actual: dict, expected: dict, rtol: float) -> None:
    """Same FQNs, and every tensor within ``rtol`` relative (norm-wise) of the expected one."""
    assert sorted(actual) == sorted(expected), (
        f"FQNs differ: only actual {sorted(set(actual) - set(expected))[:5]}, "
        f"only expected {sorted(set(expected) - set(actual))[:5]}")
    worst = sorted(((rel_err(actual[k], expected[k]), k) for k in expected), reverse=True)
    assert worst[0][0] <= rtol, f"largest relative errors (rtol {rtol}): {worst[:3]}"

# Grouped-GEMM experts vs the per-expert loop (tests/torch_impl/test_grouped.py): fp32 must
# agree to reassociation; bf16 to a few bf16 ulps (grouped_mm and mm may round differently).
GROUPED_RTOL = {"fp32": 1e-6, "bf16": 2e-2}
