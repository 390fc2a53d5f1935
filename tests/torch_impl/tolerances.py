"""The torch suite's tolerances, per dtype: relative, ``||a − b|| / ||b||`` per tensor (and
``|a − b| / |b|`` for scalars), between a sharded run and its single-process twin."""

from __future__ import annotations

RTOL = {"fp32": 1e-5}

# Grouped-GEMM experts vs the per-expert loop (tests/torch_impl/test_grouped.py): fp32 must
# agree to reassociation; bf16 to a few bf16 ulps (grouped_mm and mm may round differently).
GROUPED_RTOL = {"fp32": 1e-6, "bf16": 2e-2}
