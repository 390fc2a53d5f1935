"""NVMe swap throughput: ``moezero.offload.aio.AsyncIO`` against ``dd`` on the same folder.

Dropping the page cache needs root, so neither side may lean on it: writes are fsynced
(``AsyncIO(fsync=True)``; ``dd oflag=direct conv=fsync``) and reads bypass the cache
(O_DIRECT when the filesystem allows it; the result says whether it did, since buffered
reads of a just-written file measure memory, not the disk). Rounds are interleaved, a fresh
file per write, and the median of ``repeats`` is reported in MB/s (10^6 bytes/s).

Run: ``python -m benchmarks.swap [FOLDER] [--mib 512] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from moezero.offload.aio import AsyncIO, aligned_empty
from moezero.plan.bytes_io import CHUNK

_DD_COPIED = re.compile(r"(\d+) bytes .*copied, ([0-9.]+) s")
DD_BLOCK = 8 << 20


def swap_throughput(folder: str | os.PathLike, nbytes: int, repeats: int = 3, *,
                    workers: int = 4) -> dict:
    """Write and read an ``nbytes`` swap file with AsyncIO and with ``dd``, ``repeats`` times.

    ``nbytes`` is rounded up to a multiple of dd's 8 MiB block. Files live in a temporary
    folder under ``folder``, removed afterwards.

    Returns:
        ``{"nbytes", "repeats", "workers", "o_direct", "moezero": {"write", "read"},
        "dd": {"write", "read"}, "ratio": {"write", "read"}}``: medians in MB/s, and
        moezero / dd.
    """
    nbytes = -(-nbytes // DD_BLOCK) * DD_BLOCK
    tmp = tempfile.mkdtemp(prefix="swap-bench-", dir=folder)
    buf = aligned_empty(nbytes, torch.uint8)
    buf.view(-1, 4096).copy_(torch.arange(4096).to(torch.uint8))  # not all zeros
    ours, dd = {"write": [], "read": []}, {"write": [], "read": []}
    try:
        with AsyncIO(workers, fsync=True) as aio:
            target = os.path.join(tmp, "moezero.swap")
            for _ in range(repeats):
                for op, seconds in _aio_round(aio, target, buf).items():
                    ours[op].append(nbytes / seconds / 1e6)
                for op, seconds in _dd_round(os.path.join(tmp, "dd.bin"), nbytes).items():
                    dd[op].append(nbytes / seconds / 1e6)
            direct = aio.uses_direct(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ours = {op: statistics.median(v) for op, v in ours.items()}
    dd = {op: statistics.median(v) for op, v in dd.items()}
    return {"nbytes": nbytes, "repeats": repeats, "workers": workers, "chunk_bytes": CHUNK,
            "o_direct": direct, "moezero": ours, "dd": dd,
            "ratio": {op: ours[op] / dd[op] for op in ours}}


def _aio_round(aio: AsyncIO, target: str, buf: torch.Tensor) -> dict[str, float]:
    """Seconds to write (fresh file, fsynced) then read back ``buf`` with AsyncIO."""
    aio.release(target)
    if os.path.exists(target):
        os.unlink(target)
    start = time.perf_counter()
    aio.write(target, buf).result()
    write = time.perf_counter() - start
    start = time.perf_counter()
    aio.read(target, buf).result()
    return {"write": write, "read": time.perf_counter() - start}


def _dd_round(target: str, nbytes: int) -> dict[str, float]:
    """Seconds dd reports for a direct, fsynced write and a direct read of ``nbytes``."""
    if os.path.exists(target):
        os.unlink(target)
    count = nbytes // DD_BLOCK
    write = _dd("if=/dev/zero", f"of={target}", "bs=8M", f"count={count}", "oflag=direct",
                "conv=fsync")
    return {"write": write, "read": _dd(f"if={target}", "of=/dev/null", "bs=8M", "iflag=direct")}


def _dd(*args: str) -> float:
    proc = subprocess.run(["dd", *args], capture_output=True, text=True, check=False,
                          env={**os.environ, "LC_ALL": "C"})
    match = _DD_COPIED.search(proc.stderr)
    if proc.returncode or not match:
        lines = proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"]
        raise RuntimeError(f"dd {' '.join(args)}: {lines[-1]}")
    return float(match.group(2))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default=tempfile.gettempdir())
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args(argv)
    res = swap_throughput(args.folder, args.mib << 20, args.repeats, workers=args.workers)
    print(f"swap file {res['nbytes'] >> 20} MiB in {args.folder}, {res['repeats']} rounds, "
          f"{res['workers']} workers, O_DIRECT {'on' if res['o_direct'] else 'OFF'}")
    print(f"{'':8} {'moezero MB/s':>13} {'dd MB/s':>10} {'ratio':>7}")
    for op in ("write", "read"):
        print(f"{op:8} {res['moezero'][op]:13.0f} {res['dd'][op]:10.0f} {res['ratio'][op]:7.2f}")
    return res


if __name__ == "__main__":
    main()
