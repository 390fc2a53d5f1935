"""The torch suite's tolerances, per dtype: relative, ``||a − b|| / ||b||`` per tensor (and
``|a − b| / |b|`` for scalars), between a sharded run and its single-process twin."""

from __future__ import annotations

RTOL = {"fp32": 1e-5}
