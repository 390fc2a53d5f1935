"""Starting the ranks: join a ``torchrun`` world, run alone, or spawn N local ranks.

With the CLI, the only module that reads moezero's environment variables (torchrun's;
docs/design.md, "The environment"). Spawned ranks meet through a FileStore in a fresh temporary
folder (``rendezvous``: removed on the way out, stale ones on the next start),
every process group has a timeout, and the parent watches its children: a rank that fails
takes the others down and its error is shown (one line for an expected error,
``failures.RankFailure``; the traceback otherwise); a rank that dies of a signal or stops
beating (``heartbeat``) is named in one line, not the peer whose collective then failed;
Ctrl-C stops every rank. A child whose parent dies gets a signal from the kernel: with
preemption on, ``PARENT_DEATH_SIGNAL`` (it saves as for SIGTERM), else SIGTERM; a child whose
parent died before it armed that signal (in its first seconds) sees that and exits.

Preemption (``signals``, docs/reliability.md): with ``preempt`` options each rank handles the
preemption signals, and the spawning parent handles them too: the first sets a flag every
rank reads (``rendezvous.Flag``) at its next step boundary, so all ranks finish their step,
save and exit with ``PREEMPTED_EXIT``; a second one kills the ranks at once and exits with
128 + the signal.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moezero.distributed import rendezvous
from moezero.distributed.devices import place_rank
from moezero.distributed.failures import FAILED_EXIT, RankFailure
from moezero.distributed.heartbeat import Beat, Pulse, WatchOptions
from moezero.distributed.signals import (
    PARENT_DEATH_SIGNAL,
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
           preempt: PreemptOptions | None = None, watch: WatchOptions | None = None) -> int:
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
    return spawn(fn, nproc, args, backend=backend, timeout_s=timeout_s, preempt=preempt,
                 watch=watch)


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
          timeout_s: float = 300.0, preempt: PreemptOptions | None = None,
          watch: WatchOptions | None = None) -> int:
    """Run ``fn(*args)`` on ``nproc`` fresh processes joined in one process group.

    Returns 0 when all succeed, ``PREEMPTED_EXIT`` when they stopped for a preemption signal,
    ``FAILED_EXIT`` when a rank failed with an expected error (one line printed), 1 when a rank
    crashed (its traceback is printed), 130 on Ctrl-C, 128 + N when signal N came twice; a rank
    that died of a signal or stopped beating for ``watch.heartbeat_s`` is named in one line
    (``FAILED_EXIT``). With ``nproc == 1`` it runs in this process without a process group.
    """
    if nproc == 1:
        stop = StopRequest(preempt).install() if preempt else None
        try:
            return _outcome_here(lambda: fn(*args, **_stop_kw(stop)))
        finally:
            if stop is not None:
                stop.uninstall()
    watch = watch or WatchOptions()
    with rendezvous.folder() as tmp:
        event = rendezvous.Flag(tmp / "preempt") if preempt else None
        ctx = mp.start_processes(
            _child, args=(nproc, str(tmp), backend, timeout_s, fn, args, preempt, event,
                          watch.heartbeat_s, os.getpid()),
            nprocs=nproc, join=False, start_method="spawn")
        pulse = Pulse(tmp, watch.heartbeat_s, startup_s=max(watch.heartbeat_s, timeout_s))
        with _Forwarding(preempt, event):
            try:
                ending = _watch(ctx, pulse)
            except (KeyboardInterrupt, _Abort) as exc:
                _stop_all(ctx, grace=0.0 if isinstance(exc, _Abort) else GRACE_S)
                return _interrupted(exc)
        return _outcome(ending, tmp, watch.log_dir)


def _stop_kw(stop: StopRequest | None) -> dict:
    return {} if stop is None else {"stop": stop}


class _Abort(Exception):  # a control-flow signal, not an error
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


@dataclass(frozen=True)
class _Ending:
    """How the ranks ended: exit codes, the ranks the launcher killed, a silent rank."""

    codes: dict[int, int]
    killed: frozenset[int] = frozenset()
    silent: tuple[int, float] | None = None


def _watch(ctx, pulse: Pulse) -> _Ending:
    """Exit codes of every rank; when one fails (neither 0 nor preempted), the others get
    ``GRACE_S`` to exit on their own and are then killed; when one stops beating, all are
    killed at once."""
    sentinels = {p.sentinel: i for i, p in enumerate(ctx.processes)}
    codes: dict[int, int] = {}
    while sentinels:
        for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=0.5):
            index = sentinels.pop(sentinel)
            ctx.processes[index].join()
            codes[index] = ctx.processes[index].exitcode
            if codes[index] not in (0, PREEMPTED_EXIT):
                return _end(ctx, codes, grace=GRACE_S)
        silent = pulse.silent(sentinels.values())
        if silent is not None:
            return _end(ctx, codes, grace=0.0, silent=silent)
    return _Ending(codes)


def _end(ctx, codes: dict[int, int], grace: float,
         silent: tuple[int, float] | None = None) -> _Ending:
    killed = _stop_all(ctx, grace)
    codes.update({i: p.exitcode for i, p in enumerate(ctx.processes) if i not in codes})
    return _Ending(codes, killed, silent)


def _stop_all(ctx, grace: float) -> frozenset[int]:
    """Wait up to ``grace`` seconds for the ranks to exit, then SIGKILL the rest (SIGTERM
    would only ask them to save); returns the ranks killed."""
    deadline = time.monotonic() + grace
    for proc in ctx.processes:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    killed = set()
    for index, proc in enumerate(ctx.processes):
        if proc.is_alive():
            proc.kill()
            killed.add(index)
        proc.join(timeout=10)
    return frozenset(killed)


def _outcome(ending: _Ending, tmp: Path, log_dir: Path | None) -> int:
    """The run's exit code from its ranks' (printing the first failure, if any)."""
    codes = ending.codes
    if all(c == 0 for c in codes.values()):
        return 0
    if all(c in (0, PREEMPTED_EXIT) for c in codes.values()):
        return PREEMPTED_EXIT
    blamed = _blame(ending)
    if blamed is not None:
        rank, cause = blamed
        print(f"moezero: error: rank {rank}: {cause}; the other ranks were stopped"
              f"{_note(log_dir, rank, cause)}", file=sys.stderr, flush=True)
        return FAILED_EXIT
    recorded = sorted(_records(tmp), key=lambda r: r["time"])
    if not recorded:
        rank, code = next((i, c) for i, c in sorted(codes.items()) if c not in (0, PREEMPTED_EXIT))
        print(f"moezero: rank {rank} died (exit code {code}); the other ranks were stopped",
              file=sys.stderr, flush=True)
        return 1
    first = recorded[0]
    if first["expected"]:
        print(f"moezero: error: {first['message']}", file=sys.stderr, flush=True)
        return FAILED_EXIT
    print(f"moezero: rank {first['rank']} failed; the other ranks were stopped:\n"
          f"{first['message']}", file=sys.stderr, flush=True)
    return 1


def _blame(ending: _Ending) -> tuple[int, str] | None:
    """The rank that stopped beating, else the first that died of a signal the launcher did
    not send: its peers' errors (a closed connection) are only the consequence."""
    if ending.silent is not None:
        rank, age = ending.silent
        return rank, f"no heartbeat for {age:.0f} s (hung or stopped)"
    for rank, code in sorted(ending.codes.items()):
        if code is not None and code < 0 and rank not in ending.killed:
            return rank, f"died (signal {signal.Signals(-code).name})"
    return None


def _note(log_dir: Path | None, rank: int, cause: str) -> str:
    """Append ``cause`` to the rank's log; `` (log: <path>)`` for its line."""
    if log_dir is None:
        return ""
    path = Path(log_dir) / f"rank{rank}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as log:
            log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} moezero launcher: rank {rank}: "
                      f"{cause}\n")
    except OSError:
        return ""
    return f" (log: {path})"


def _records(tmp: Path) -> list[dict]:
    out = []
    for path in tmp.glob("error-*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # a rank killed while writing it
            pass
    return out


def _child(rank: int, world: int, tmp: str, backend: str, timeout_s: float, fn, args,
           preempt: PreemptOptions | None, event, heartbeat_s: float, parent: int) -> None:
    """Entry point of a spawned rank; holds the rendezvous folder, beats, records its error
    with a timestamp for the parent and exits with the rank's outcome. ``parent`` is the
    launcher's pid: a rank whose launcher died before it armed its parent-death signal exits
    at once."""
    stop = StopRequest(preempt, event).install(parent_death=True) if preempt else None
    _die_with_parent(PARENT_DEATH_SIGNAL if preempt else signal.SIGTERM)
    if os.getppid() != parent:  # died before the signal was armed: nobody would send it
        print(f"moezero: rank {rank}: the launcher (pid {parent}) died before this rank "
              "started; exiting", file=sys.stderr, flush=True)
        sys.exit(FAILED_EXIT)
    held = rendezvous.hold(tmp)  # noqa: F841 (held until this process ends)
    Beat(tmp, rank, heartbeat_s).start()
    torch.set_num_threads(max(1, cpu_count() // world))
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


def _die_with_parent(signum: int) -> None:
    """Linux: send ``signum`` to this rank when the launching process dies (no orphans; with
    preemption handlers it saves first)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, int(signum))
        except OSError:
            pass
