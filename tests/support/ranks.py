"""Start a test's gloo ranks from a fork server that imported torch and moezero once.

moezero's launcher (``moezero.distributed.launcher.spawn``) starts every rank as a fresh
interpreter, which imports torch and moezero again: 2-3 s of CPU per rank on CI's 2-core box,
the largest part of a short W=2 test. ``run_world`` (tests/support/world.py) only needs ranks
joined in a process group, so it forks them from one server per pytest process
(``multiprocessing``'s forkserver with ``PRELOAD`` imported): each rank starts in a few
milliseconds. The server is started on first use; it computes nothing and starts no thread, so
a forked rank begins in the state a fresh process has after those imports, except that the
ranks of a world share the server's random state where fresh processes would each draw their
own (torch's initial seed, numpy's global generator, the string hash seed; Python's ``random``
is reseeded at fork): every test seeds what it compares.

What a rank gets from the test, as a spawned one would: the environment as it is when the
world starts (the server's is the one it started with), the working directory and
``sys.path``, the test's stdout and stderr (pytest's capture), one torch thread per
``cores // world``. Its exit is ``os._exit`` after the process group is torn down
(``multiprocessing``'s forked children skip the interpreter's teardown). moezero's launcher
itself (rendezvous folder, heartbeats, parent-death signals, failure reports) keeps its own
tests, and the CLI tests start their ranks through it.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
from datetime import timedelta
from multiprocessing import reduction
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "numpy", "moezero", "moezero.engine", "moezero.train",
           "moezero.cli", "tests.support.world")
"""What the fork server imports once (``multiprocessing.forkserver``: a module that fails to
import is skipped there and imported by the rank that needs it)."""

GRACE_S = 5.0
"""Seconds the other ranks get to exit on their own after one failed, before they are killed
(a rank waiting in a collective for the dead one would otherwise wait out its timeout)."""

_PR_SET_PDEATHSIG = 1


class RankTime:
    """The CPU seconds the forked ranks of this process's worlds used (each rank reports its
    own at exit): they are not this process's children, so ``os.times`` does not count them,
    and the parallel pass's check (``tests.support.spawns.ChildTime``) adds them."""

    seconds = 0.0

    @classmethod
    def add(cls, folder: str) -> None:
        for path in Path(folder).glob("cpu-*"):
            cls.seconds += float(path.read_text() or 0.0)


class _Fd:
    """One of this process's file descriptors, handed to a forked rank (``multiprocessing``
    sends it to the fork server with the process, as it does for its own pipes)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _attach, (reduction.DupFd(self.fd),)


def _attach(dup) -> int:
    return dup.detach()


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def start_world(target, world: int, args: tuple, timeout_s: float, backend: str = "gloo") -> int:
    """``target(*args)`` on ``world`` forked ranks joined in one process group (a FileStore in
    a fresh temporary folder, ``timeout_s`` per collective). Returns 0 when every rank
    succeeded, else the first failed rank's exit code (its traceback is on stderr); when
    one fails, the others get ``GRACE_S`` to exit and are then killed."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    ctx = _context()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="moezero-test-world-") as tmp:
        procs = [ctx.Process(target=_rank, name=f"rank{rank}", args=(
            rank, world, f"file://{tmp}/store", backend, timeout_s, target, args, env,
            (_Fd(1), _Fd(2)))) for rank in range(world)]
        try:
            for proc in procs:
                proc.start()
            return _wait(procs)
        finally:
            _stop(procs, grace=0.0)
            RankTime.add(tmp)


def _wait(procs: list) -> int:
    """0 when every rank exits with 0; else the first failure's code, after ``_stop``."""
    running = {proc.sentinel: proc for proc in procs}
    while running:
        for sentinel in multiprocessing.connection.wait(list(running)):
            proc = running.pop(sentinel)
            proc.join()
            if proc.exitcode != 0:
                _stop(procs, grace=GRACE_S)
                return proc.exitcode
    return 0


def _stop(procs: list, grace: float) -> None:
    deadline = time.monotonic() + grace
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


def _rank(rank: int, world: int, init_method: str, backend: str, timeout_s: float, target,
          args: tuple, env: dict, fds: tuple) -> None:
    """A forked rank: the test's environment and output streams, then ``target(*args)`` in
    the process group."""
    _die_with_server()
    os.environ.clear()
    os.environ.update(env)
    for fd, inherited in zip((1, 2), fds, strict=True):
        os.dup2(inherited, fd)
        os.close(inherited)
    import torch
    import torch.distributed as dist

    from moezero.distributed.devices import place_rank

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    place_rank(backend, rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        target(*args)
        dist.barrier()  # no rank leaves while a peer still sets up or reads its connections
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        dist.destroy_process_group()
        times = os.times()
        Path(init_method.removeprefix("file://")).with_name(f"cpu-{rank}").write_text(
            str(times.user + times.system))


def _die_with_server() -> None:
    """SIGKILL this rank when the fork server dies (it exits with the pytest process that
    started it): no rank outlives an interrupted test run."""
    try:
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except OSError:
        pass
