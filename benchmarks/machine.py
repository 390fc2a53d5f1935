"""The machine and its limits, measured in the same run as the benchmarks.

``dd`` with ``oflag=direct`` / ``iflag=direct`` gives the disk's write/read bandwidth (the
line checkpoint saves are compared against); a large torch tensor copy gives the memory
bandwidth (the line an optimizer step, which streams its fp32 state, is compared against).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

_DD_COPIED = re.compile(r"(\d+) bytes .*copied, ([0-9.]+) s")


def machine_info() -> dict:
    """CPU model, cores, memory, Python and torch versions, date (UTC)."""
    cpu = platform.processor() or "unknown"
    mem_bytes = None
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            mem_bytes = int(line.split()[1]) * 1024
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "mem_bytes": mem_bytes,
            "python": platform.python_version(), "torch": torch.__version__,
            "os": f"{platform.system()} {platform.release()}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def dd_bandwidth(folder: str | os.PathLike, mib: int) -> dict:
    """Direct-I/O write then read of ``mib`` MiB in a temporary folder under ``folder``.

    Returns ``{"write": bytes/s, "read": bytes/s, "write_buffered": bytes/s}`` (the last: a
    page-cache write flushed by ``conv=fsync``, the path a buffered ``pwrite`` + ``fsync``
    takes); a failed dd gives ``{"error": line}``.
    The folder is removed afterwards.
    """
    tmp = tempfile.mkdtemp(prefix="dd-", dir=folder)
    target = os.path.join(tmp, "dd.bin")
    try:
        write = _dd(_dd_write_args(target, mib))
        read = _dd([f"if={target}", "of=/dev/null", "bs=8M", "iflag=direct"])
        buffered = _dd(["if=/dev/zero", f"of={target}.b", "bs=8M", f"count={mib // 8}",
                        "conv=fsync"])
        return {"write": write, "read": read, "write_buffered": buffered}
    except RuntimeError as exc:
        return {"error": str(exc)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


DD_BESIDE_MIB = 256
"""Size of the dd write run right before and right after each timed checkpoint save
(``worker._dd_beside``)."""


def _dd_write_args(target: str, mib: int) -> list[str]:
    return ["if=/dev/zero", f"of={target}", "bs=8M", f"count={mib // 8}", "oflag=direct"]


def dd_write(folder: str | os.PathLike, mib: int) -> float:
    """Bytes/s of a direct-I/O dd write of ``mib`` MiB to a file in ``folder``: the line
    ``dd_bandwidth`` reports as "dd write", measured again beside a checkpoint save. The file
    is removed and the removal synced before returning, so none of it is left for the next
    (timed) flush to commit."""
    target = os.path.join(folder, f".dd-{os.getpid()}.bin")
    try:
        return _dd(_dd_write_args(target, mib))
    finally:
        Path(target).unlink(missing_ok=True)
        os.sync()


def _dd(args: list[str]) -> float:
    proc = subprocess.run(["dd", *args], capture_output=True, text=True,
                          env={**os.environ, "LC_ALL": "C"}, check=False)
    match = _DD_COPIED.search(proc.stderr)
    if proc.returncode or not match:
        lines = proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"]
        raise RuntimeError(f"dd {' '.join(args)}: {lines[-1]}")
    return int(match.group(1)) / float(match.group(2))


def memcpy_bandwidth(mib: int, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by ``dst.copy_(src)`` of ``mib`` MiB, one thread.

    One thread because each benchmarked rank runs with one (2 ranks on 2 cores); the median
    of ``repeats`` copies after a warm-up copy.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(mib * 2**20 // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return 2 * src.numel() * 4 / sorted(times)[len(times) // 2]
    finally:
        torch.set_num_threads(threads)


def swap_bandwidth(folder: str | os.PathLike, mib: int, repeats: int = 2) -> dict:
    """NVMe swap-file throughput from ``benchmarks.swap.swap_throughput`` (AsyncIO vs dd),
    measured in a temporary folder under ``folder``; ``{"error": line}`` when that module
    does not exist yet or fails."""
    if importlib.util.find_spec("benchmarks.swap") is None:
        return {"error": "not available (benchmarks/swap.py does not exist yet)"}
    tmp = tempfile.mkdtemp(prefix="swap-", dir=folder)
    try:
        from benchmarks.swap import swap_throughput

        return {"mib": mib, "repeats": repeats, **swap_throughput(tmp, mib * 2**20, repeats)}
    except Exception as exc:  # another engineer's module: report its failure, do not crash
        return {"error": f"swap_throughput failed: {type(exc).__name__}: {exc}"[:300]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
