"""Starting the ranks: join a ``torchrun`` world, run alone, or spawn N local ranks.

The only module that reads environment variables. Spawned ranks meet through a FileStore in a
fresh temporary folder (no port races), every process group has a timeout, and the parent
watches its children: a rank that fails takes the others down and its error is shown (one
line for an expected error, ``failures.RankFailure``; the traceback otherwise); Ctrl-C stops
every rank; a child whose parent dies gets SIGTERM from the kernel.

Preemption (``signals``, docs/reliability.md): with ``preempt`` options each rank handles the
preemption signals, and the spawning parent handles them too: the first sets an event every
rank reads at its next step boundary, so all ranks finish their step, save and exit with
``PREEMPTED_EXIT``; a second one kills the ranks at once and exits with 128 + the signal.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moezero.distributed.devices import place_rank
from moezero.distributed.failures import FAILED_EXIT, RankFailure
from moezero.distributed.signals import (
    PREEMPTED_EXIT,
    Preempted,
    PreemptOptions,
    StopRequest,
    abort_code,
)

_PR_SET_PDEATHSIG = 1
INTERRUPTED_EXIT = 130
GRACE_S = 5.0
"""Seconds the other ranks get to exit on their own after one failed (they are usually
reporting the same agreed error), before they are killed."""


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def launch(fn: Callable, args: tuple, *, nproc: int, backend: str, timeout_s: float,
           preempt: PreemptOptions | None = None) -> int:
    """Run ``fn(*args)`` on ``nproc`` local ranks, or on this rank of the torchrun world.

    With ``preempt``, ``fn`` is called with ``stop=`` a ``StopRequest`` and may raise
    ``Preempted`` after saving. Returns a process exit code: 0, ``FAILED_EXIT`` (an expected
    error, printed as one line), 1 (a crash), ``PREEMPTED_EXIT``, 130 (Ctrl-C) or 128 + the
    signal that aborted it.
    """
    if under_torchrun():
        stop = StopRequest(preempt).install() if preempt else None
        return _outcome_here(lambda: _in_process_group(
            fn, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", backend,
            timeout_s, args, local_rank=int(os.environ["LOCAL_RANK"]), stop=stop))
    if nproc > cpu_count() and backend == "gloo":
        warnings.warn(f"--nproc {nproc} is more than the {cpu_count()} CPU cores here: "
                      "ranks will compete for cores and run slowly", stacklevel=2)
    return spawn(fn, nproc, args, backend=backend, timeout_s=timeout_s, preempt=preempt)


def _outcome_here(run: Callable[[], None]) -> int:
    """Exit code of a rank run in this process: ``Preempted`` and ``RankFailure`` are
    outcomes (the latter printed as one line); anything else propagates."""
    try:
        run()
    except Preempted:
        return PREEMPTED_EXIT
    except RankFailure as failure:
        print(f"moezero: error: {failure}", file=sys.stderr, flush=True)
        return FAILED_EXIT
    return 0


def spawn(fn: Callable, nproc: int, args: tuple = (), *, backend: str = "gloo",
          timeout_s: float = 300.0, preempt: PreemptOptions | None = None) -> int:
    """Run ``fn(*args)`` on ``nproc`` fresh processes joined in one process group.

    Returns 0 when all succeed, ``PREEMPTED_EXIT`` when they stopped for a preemption signal,
    ``FAILED_EXIT`` when a rank failed with an expected error (one line printed), 1 when a rank
    crashed (its traceback is printed), 130 on Ctrl-C, 128 + N when signal N came twice. With
    ``nproc == 1`` it runs in this process without a process group.
    """
    if nproc == 1:
        stop = StopRequest(preempt).install() if preempt else None
        try:
            return _outcome_here(lambda: fn(*args, **_stop_kw(stop)))
        finally:
            if stop is not None:
                stop.uninstall()
    with tempfile.TemporaryDirectory(prefix="moezero-rdzv-") as tmp:
        event = multiprocessing.get_context("spawn").Event() if preempt else None
        ctx = mp.start_processes(
            _child, args=(nproc, tmp, backend, timeout_s, fn, args, preempt, event),
            nprocs=nproc, join=False, start_method="spawn")
        with _Forwarding(preempt, event):
            try:
                codes = _watch(ctx)
            except (KeyboardInterrupt, _Abort) as exc:
                _stop_all(ctx, grace=0.0 if isinstance(exc, _Abort) else GRACE_S)
                return _interrupted(exc)
        return _outcome(codes, Path(tmp))


def _stop_kw(stop: StopRequest | None) -> dict:
    return {} if stop is None else {"stop": stop}


class _Abort(Exception):  # noqa: N818 (a control-flow signal)
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupted(exc: BaseException) -> int:
    if isinstance(exc, _Abort):
        name = signal.Signals(exc.signum).name
        print(f"moezero: {name} again: aborted at once, nothing saved since the last "
              "checkpoint", file=sys.stderr, flush=True)
        return abort_code(exc.signum)
    print("moezero: interrupted; every rank stopped", file=sys.stderr, flush=True)
    return INTERRUPTED_EXIT


class _Forwarding:
    """The parent's preemption handlers: the first signal sets the ranks' event, a second
    raises ``_Abort`` in the watching loop."""

    def __init__(self, preempt: PreemptOptions | None, event):
        self.signals = preempt.signals if preempt else ()
        self.event, self.previous = event, {}

    def __enter__(self) -> _Forwarding:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._on_signal) for s in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)

    def _on_signal(self, signum: int, frame) -> None:
        if self.event.is_set():
            raise _Abort(signum)
        self.event.set()
        print(f"moezero: {signal.Signals(signum).name}: every rank saves after its current "
              "step, then exits (send it again to abort)", file=sys.stderr, flush=True)


def _watch(ctx) -> dict[int, int]:
    """Exit codes of every rank; when one fails (neither 0 nor preempted), the others get
    ``GRACE_S`` to exit on their own and are then killed."""
    sentinels = {p.sentinel: i for i, p in enumerate(ctx.processes)}
    codes: dict[int, int] = {}
    while sentinels:
        for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=0.5):
            index = sentinels.pop(sentinel)
            ctx.processes[index].join()
            codes[index] = ctx.processes[index].exitcode
            if codes[index] not in (0, PREEMPTED_EXIT):
                _stop_all(ctx, grace=GRACE_S)
                codes.update({i: p.exitcode for i, p in enumerate(ctx.processes) if i not in codes})
                return codes
    return codes


def _stop_all(ctx, grace: float) -> None:
    """Wait up to ``grace`` seconds for the ranks to exit, then SIGKILL the rest (SIGTERM
    would only ask them to save)."""
    deadline = time.monotonic() + grace
    for proc in ctx.processes:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)


def _outcome(codes: dict[int, int], tmp: Path) -> int:
    """The run's exit code from its ranks' (printing the first failure, if any)."""
    if all(c == 0 for c in codes.values()):
        return 0
    if all(c in (0, PREEMPTED_EXIT) for c in codes.values()):
        return PREEMPTED_EXIT
    recorded = sorted(_records(tmp), key=lambda r: r["time"])
    if not recorded:
        rank, code = next((i, c) for i, c in sorted(codes.items()) if c not in (0, PREEMPTED_EXIT))
        how = (f"signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit code {code}")
        print(f"moezero: rank {rank} died ({how}); the other ranks were stopped",
              file=sys.stderr, flush=True)
        return 1
    first = recorded[0]
    if first["expected"]:
        print(f"moezero: error: {first['message']}", file=sys.stderr, flush=True)
        return FAILED_EXIT
    print(f"moezero: rank {first['rank']} failed; the other ranks were stopped:\n"
          f"{first['message']}", file=sys.stderr, flush=True)
    return 1


def _records(tmp: Path) -> list[dict]:
    out = []
    for path in tmp.glob("error-*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # a rank killed while writing it
            pass
    return out


def _child(rank: int, world: int, tmp: str, backend: str, timeout_s: float, fn, args,
           preempt: PreemptOptions | None, event) -> None:
    """Entry point of a spawned rank; records its error with a timestamp for the parent and
    exits with the rank's outcome."""
    _die_with_parent()
    torch.set_num_threads(max(1, cpu_count() // world))
    stop = StopRequest(preempt, event).install() if preempt else None
    try:
        _in_process_group(fn, rank, world, f"file://{tmp}/store", backend, timeout_s, args,
                          local_rank=rank, error_file=Path(tmp, f"error-{rank}.json"), stop=stop)
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED_EXIT)
    except Preempted:
        sys.exit(PREEMPTED_EXIT)
    except RankFailure:
        sys.exit(FAILED_EXIT)


def _in_process_group(fn, rank: int, world: int, init_method: str, backend: str,
                      timeout_s: float, args: tuple, *, local_rank: int,
                      error_file: Path | None = None, stop: StopRequest | None = None) -> None:
    place_rank(backend, local_rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(*args, **_stop_kw(stop))
    except Preempted:
        raise
    except Exception as exc:
        if error_file is not None:  # stamped before teardown makes the peers fail too
            expected = isinstance(exc, RankFailure)
            message = str(exc) if expected else traceback.format_exc()
            error_file.write_text(json.dumps({"time": time.time(), "rank": rank,
                                              "expected": expected, "message": message}))
        raise
    finally:
        dist.destroy_process_group()


def _die_with_parent() -> None:
    """Linux: SIGTERM this rank when the launching process dies (no orphans; with
    preemption handlers it saves first)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass
