"""Peak host memory of one action, measured in a fresh child process (test-only).

``PEAK_PRELUDE`` defines ``measure(action)`` for the child's script: it resets the peak RSS
(``VmHWM``, via ``/proc/self/clear_refs``) to the current RSS, runs ``action`` and prints the
growth of the peak in bytes. ``peak_growth(script, *args)`` runs ``PEAK_PRELUDE + script``
with a fixed mmap threshold and one thread, and returns the integers the child printed.
RSS is per process: other jobs on the machine do not change it; what could (the allocator
keeping freed blocks) is pinned by ``MEASURE_ENV``.
"""

from __future__ import annotations

import os
import subprocess
import sys

# glibc hands freed blocks of over 128 KiB back at once, so the peak RSS measures what is
# alive rather than what the heap kept after an earlier, larger buffer.
MEASURE_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}

PEAK_PRELUDE = r"""
import sys
import torch
from moezero.telemetry import PeakMemory

def measure(action):
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    assert memory.resettable, "cannot reset the peak RSS (/proc/self/clear_refs)"
    before = memory.peak()
    action()
    return memory.peak() - before
"""


def peak_growth(script: str, *args, timeout: float = 600) -> list[int]:
    """Run ``script`` (after ``PEAK_PRELUDE``) with ``args`` in a fresh interpreter; the
    integers it printed on its last line."""
    run = subprocess.run([sys.executable, "-c", PEAK_PRELUDE + script, *map(str, args)],
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **MEASURE_ENV})
    assert run.returncode == 0, run.stderr[-4000:]
    return [int(x) for x in run.stdout.split("\n")[-2].split()]
