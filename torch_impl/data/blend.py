"""Which dataset each global sample of a weighted blend comes from: a pure function.

Dataset ``d`` (weight ``w_d``, the weights normalised) owns the sample times
``(j + 1/2) / w_d`` for ``j = 0, 1, ...``; merging every dataset's times (ties: lower ``d``
first) gives the blend's order: global sample ``k`` is the ``k``-th time, and it is sample
``j`` of dataset ``d``. Among the first ``n`` samples dataset ``d`` has ``w_d n`` of them to
within ``1/2 + w_d D/2`` (D datasets; a low-discrepancy interleaving like Megatron's blended
index, without its sequential loop), and any range ``[start, stop)`` is computed on its own —
so a resumed run picks up the same order from any global position.
"""

from __future__ import annotations

import math

import numpy as np


def normalise(weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(w > 0) or not np.all(np.isfinite(w)):
        raise ValueError(f"blend weights must be positive and finite, got {weights}")
    return w / w.sum()


def _before(weight: float, time: float) -> int:
    """How many of one dataset's times ``(j + 1/2) / weight`` are ``< time`` (exact in the
    floats the merge compares)."""
    n = max(0, math.ceil(time * weight - 0.5))
    while n > 0 and (n - 1 + 0.5) / weight >= time:
        n -= 1
    while (n + 0.5) / weight < time:
        n += 1
    return n


def blend_positions(weights: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset, sample-within-dataset) of global samples ``[start, stop)``, int64 each."""
    if weights.size == 1:
        return np.zeros(stop - start, np.int64), np.arange(start, stop, dtype=np.int64)
    slack = weights.size + 1.0  # the k-th time lies within (k - D/2, k + D/2]
    lo, hi = max(0.0, start - slack), stop + slack
    counts = [(_before(w, lo), _before(w, hi)) for w in weights]
    dataset = np.concatenate([np.full(b - a, d, np.int64) for d, (a, b) in enumerate(counts)])
    within = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in counts])
    times = (within + 0.5) / weights[dataset]
    order = np.lexsort((dataset, times))
    first = start - sum(a for a, _ in counts)
    if first < 0 or first + (stop - start) > order.size:
        raise AssertionError(f"blend window [{lo}, {hi}) misses samples [{start}, {stop})")
    take = order[first:first + stop - start]
    return dataset[take], within[take]
