"""The peak memory of this process on a device: what ``metrics.jsonl``'s ``peak_mem_bytes``
and ``moezero.telemetry.PeakMemory`` report (docs/design.md, "Who imports whom": both read it
here, so telemetry never imports the engine)."""

from __future__ import annotations

import re
import resource
from pathlib import Path

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on GPU; on CPU this program's peak RSS (``VmHWM``; ``ru_maxrss``
    where ``/proc`` is missing: on Linux it keeps the peak of the process this one was forked
    from, e.g. a launcher, so it is only the fallback)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
