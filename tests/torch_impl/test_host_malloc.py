"""Offloaded runs return freed large host blocks to the OS (moezero.offload.malloc).

Each case runs in a fresh interpreter: glibc's threshold is per process and only moves up.
The pattern is the one an offloaded step repeats: a large buffer freed, the next one of that
size allocated, a small live block behind it, the large one freed again.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys, torch
from moezero.config import load_config
from moezero.engine import _host_blocks
from moezero.offload.options import IOOptions
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
cfg = load_config(None, sys.argv[1:])
_host_blocks(cfg.zero_optimization, IOOptions())
MiB = 1 << 20
x = torch.ones(8 * MiB // 4); del x      # a mapped block freed: glibc's threshold moves to 8 MiB
a = torch.ones(8 * MiB // 4)              # the next one of that size
b = torch.ones(16 * 1024)                 # a small live block behind it
before = rss(); del a; after = rss()
print((before - after) / MiB)
"""


def returned_mib(*overrides: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, *overrides], capture_output=True,
                         text=True, timeout=120, check=True)
    return float(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_an_offloaded_run_returns_a_freed_8_mib_block():
    assert returned_mib("zero_optimization.offload_optimizer.device=cpu") >= 7.5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_without_offload_glibc_keeps_it():
    """The same pattern in a run without offload (glibc left alone) keeps the block: the
    case above is the library's doing, not the pattern's."""
    assert returned_mib() < 1.0



TRIM_PROBE = """
import torch
from moezero.offload.malloc import map_large_blocks, release_free
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
map_large_blocks(1 << 20)                   # as an offloaded run: blocks < 1 MiB from the heap
held = [torch.ones(128 * 1024) for _ in range(400)]  # 400 x 512 KiB, heap blocks
tail = torch.ones(1024)                     # a live block behind them keeps the heap's top
del held
before = rss(); trimmed = release_free(); after = rss()
print(trimmed, (before - after) / (1 << 20))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux only")
def test_release_free_returns_freed_heap_blocks_behind_a_live_one():
    """What an offloaded engine does after each step (``Engine.trim_heap``)."""
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[0] == "True" and float(out[1]) >= 150, out
