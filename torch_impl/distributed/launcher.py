"""Starting the ranks: join a ``torchrun`` world, run alone, or spawn N local ranks.

The only module that reads environment variables. Spawned ranks meet through a FileStore in a
fresh temporary folder (no port races), every process group has a timeout, and the parent
watches its children: a rank that fails takes the others down and its error is shown;
Ctrl-C stops every rank; a child whose parent dies is terminated by the kernel.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_PR_SET_PDEATHSIG = 1


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def launch(fn: Callable, args: tuple, *, nproc: int, backend: str, timeout_s: float) -> int:
    """Run ``fn(*args)`` on ``nproc`` local ranks, or on this rank of the torchrun world.

    Returns a process exit code (0 when every rank returned).
    """
    if under_torchrun():
        _in_process_group(fn, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://",
                          backend, timeout_s, args, local_rank=int(os.environ["LOCAL_RANK"]))
        return 0
    if nproc > cpu_count() and not torch.cuda.is_available():
        warnings.warn(f"--nproc {nproc} is more than the {cpu_count()} CPU cores here: "
                      "ranks will compete for cores and run slowly", stacklevel=2)
    return spawn(fn, nproc, args, backend=backend, timeout_s=timeout_s)


def spawn(fn: Callable, nproc: int, args: tuple = (), *, backend: str = "gloo",
          timeout_s: float = 300.0) -> int:
    """Run ``fn(*args)`` on ``nproc`` fresh processes joined in one process group.

    Returns 0 when all succeed, 1 when a rank fails (its traceback is printed), 130 on Ctrl-C.
    With ``nproc == 1`` it runs in this process without a process group.
    """
    if nproc == 1:
        fn(*args)
        return 0
    with tempfile.TemporaryDirectory(prefix="moezero-rdzv-") as tmp:
        ctx = mp.start_processes(_child, args=(nproc, tmp, backend, timeout_s, fn, args),
                                 nprocs=nproc, join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=0.5):
                pass
        except (KeyboardInterrupt, mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            _terminate(ctx)
            interrupted = (isinstance(exc, KeyboardInterrupt)
                           or getattr(exc, "exit_code", None) == 130)
            message = ("interrupted; every rank stopped" if interrupted
                       else _first_failure(Path(tmp), exc))
            print(f"moezero: {message}", file=sys.stderr, flush=True)
            return 130 if interrupted else 1
    return 0


def _first_failure(tmp: Path, exc: Exception) -> str:
    """The root cause: the error a rank recorded first (others usually fail in collectives)."""
    recorded = sorted((float(f.read_text().split("\n", 1)[0]), f) for f in tmp.glob("error-*"))
    if not recorded:
        return (f"rank {exc.error_index} died (exit code {getattr(exc, 'exit_code', '?')}); "
                "the other ranks were stopped")
    first = recorded[0][1]
    return (f"rank {first.name.removeprefix('error-')} failed; the other ranks were stopped:\n"
            f"{first.read_text().split(chr(10), 1)[1]}")


def _terminate(ctx) -> None:
    for proc in ctx.processes:
        if proc.is_alive():
            proc.terminate()
    for proc in ctx.processes:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def _child(rank: int, world: int, tmp: str, backend: str, timeout_s: float, fn, args) -> None:
    """Entry point of a spawned rank; records its error with a timestamp for the parent."""
    _die_with_parent()
    torch.set_num_threads(max(1, cpu_count() // world))
    try:
        _in_process_group(fn, rank, world, f"file://{tmp}/store", backend, timeout_s, args,
                          local_rank=rank, error_file=Path(tmp, f"error-{rank}"))
    except KeyboardInterrupt:
        sys.exit(130)


def _in_process_group(fn, rank: int, world: int, init_method: str, backend: str,
                      timeout_s: float, args: tuple, *, local_rank: int,
                      error_file: Path | None = None) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(*args)
    except Exception:
        if error_file is not None:  # stamped before teardown makes the peers fail too
            error_file.write_text(f"{time.time()}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def _die_with_parent() -> None:
    """Linux: SIGTERM this rank when the launching process dies (no orphans)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass
