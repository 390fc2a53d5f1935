"""A dying launcher, a dead or hung rank (issue 25, items 2 and 5), through ``moezero train``.

- ``kill -9`` of the launcher: every rank finishes its step, saves it once and exits (the
  kernel's parent-death signal comes once per thread of the dead launcher and must not abort
  that save); the next start removes the dead job's rendezvous folder.
- SIGKILL of rank 1: one line naming rank 1 and the signal, pointing to ``logs/rank1.log``,
  not rank 0's failed collective.
- SIGSTOP of rank 1: named within ``dist.heartbeat_s``, long before ``dist.timeout_s``.
- The rendezvous folder is gone after every exit the launcher lives through: a finished
  run (the resume after the killed launcher), a failed rank (the dead or stopped rank),
  a preemption (the paused job's SIGTERM); each asserted in those tests, so no run of
  its own (CI time).
Each run gets its own ``TMPDIR``, so the rendezvous folders it leaves can be counted.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from moezero.distributed.signals import Preempted
from moezero.plan import store
from tests.torch_impl.test_checkpoint_cli import _ranks
from tests.torch_impl.test_cli import TINY
from tests.torch_impl.test_preemption import LONG, _rows, _wait_for_steps

PREEMPTED_EXIT, FAILED_EXIT = 75, 2


def _env(tmp: Path, **extra: str) -> dict:
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp), **extra}


def _start(args: list[str], out: Path, tmp: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moezero.cli", "train", *args, "--out",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=_env(tmp))


def _finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[str, str]:
    """stdout and stderr once every process holding them (the ranks too) has exited."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def _rdzv(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("moezero-rdzv-*"))


def _slow_saving_rank(marks: str, *, stop) -> None:
    """Steps until the ranks agree to stop, then 'saves' for two seconds (time for repeated
    signals to land in the save) and leaves a mark. Writes its pid and its parent-death
    signal (``PR_GET_PDEATHSIG``) first."""
    rank, sig = dist.get_rank(), ctypes.c_int(0)
    ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
    Path(marks, f"pid-{rank}").write_text(f"{os.getpid()} {sig.value}")
    while not stop.agree():
        time.sleep(0.05)
    Path(marks, f"saving-{rank}").touch()
    time.sleep(2.0)
    Path(marks, f"saved-{rank}").write_text(stop.reason)
    raise Preempted(0, marks)


LAUNCHER = """
import sys, threading, time
from moezero.distributed.launcher import spawn
from moezero.distributed.signals import PreemptOptions
from tests.torch_impl.test_rank_faults import _slow_saving_rank
for _ in range(8):  # the kernel sends the parent-death signal once per thread that exits
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
spawn(_slow_saving_rank, 2, (sys.argv[1],), preempt=PreemptOptions(), timeout_s=60)
"""


class _SlowToArrive:
    """An argument that takes 3 s to unpickle in a spawned rank, after it marks its arrival:
    the rank is started but has not yet armed its parent-death signal."""

    def __init__(self, marks: str):
        self.marks = marks

    def __reduce__(self):
        return _arrive_slowly, (self.marks,)


def _arrive_slowly(marks: str) -> str:
    Path(marks, f"arrived-{os.getpid()}").touch()
    time.sleep(3.0)
    return marks


def _train_unattended(marks: str, *, stop) -> None:
    """Marks that it trains, then 'trains' until asked to stop (60 s at most)."""
    Path(marks, f"trains-{dist.get_rank()}").touch()
    deadline = time.monotonic() + 60
    while not stop.agree() and time.monotonic() < deadline:
        time.sleep(0.05)


EARLY_LAUNCHER = """
import sys
from moezero.distributed.launcher import spawn
from moezero.distributed.signals import PreemptOptions
from tests.torch_impl.test_rank_faults import _SlowToArrive, _train_unattended
spawn(_train_unattended, 2, (_SlowToArrive(sys.argv[1]),), preempt=PreemptOptions(),
      timeout_s=60)
"""


@pytest.mark.parametrize("preempt", [True, False])
def test_a_launcher_killed_before_its_ranks_armed_the_parent_death_signal(tmp_path, preempt):
    """``kill -9`` of the launcher while its ranks are still starting (before they arm their
    parent-death signal): each rank finds its parent gone once it has armed it and exits
    without training (they trained on unattended before; issue 38, item 9)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = EARLY_LAUNCHER if preempt else EARLY_LAUNCHER.replace(
        "preempt=PreemptOptions(), ", "")
    proc = subprocess.Popen([sys.executable, "-c", script, str(marks)], stderr=subprocess.PIPE,
                            text=True, env=_env(tmp_path / "tmp"), start_new_session=True)
    _wait_for(marks, "arrived-*", proc)
    ranks = [int(p.name.removeprefix("arrived-")) for p in marks.glob("arrived-*")]
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    try:
        while any(_alive(pid) for pid in ranks):
            assert time.monotonic() < deadline, "the ranks outlived their launcher"
            time.sleep(0.1)
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    stderr = proc.communicate(timeout=30)[1]  # the ranks' too: they inherited it
    assert list(marks.glob("trains-*")) == []
    for rank in range(2):
        assert f"moezero: rank {rank}: the launcher (pid {proc.pid}) died before this rank " \
               "started; exiting" in stderr, stderr[-3000:]


def test_a_launcher_that_lives_has_its_ranks_train(tmp_path):
    """The control of the case above: the same launcher left alone runs both ranks."""
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", EARLY_LAUNCHER + "\nsys.exit(0)\n",
                             str(marks)], env=_env(tmp_path / "tmp"), start_new_session=True)
    _wait_for(marks, "trains-*", proc)
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


def _wait_for(marks: Path, pattern: str, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(list(marks.glob(pattern))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, pattern
        time.sleep(0.02)


def test_a_repeated_parent_death_signal_never_aborts_the_save(tmp_path):
    """The launcher is killed; while the ranks save, each gets its parent-death signal twice
    more, 40 ms apart (what the kernel does once per exiting thread of a launcher with
    threads): each rank still finishes its save once and exits."""
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(marks)],
                            env=_env(tmp_path / "tmp"), start_new_session=True)
    _wait_for(marks, "pid-*", proc)
    ranks = [tuple(map(int, (marks / f"pid-{r}").read_text().split())) for r in range(2)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while len(list(marks.glob("saving-*"))) < 2 and any(_alive(pid) for pid, _ in ranks):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for _ in range(2):
        for pid, sig in ranks:
            os.kill(pid, sig)
        time.sleep(0.04)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid, _ in ranks):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert sorted(p.name for p in marks.glob("saved-*")) == ["saved-0", "saved-1"], sorted(
        p.name for p in marks.iterdir())
    assert {p.read_text() for p in marks.glob("saved-*")} == {"the launcher died"}


def _alive(pid: int) -> bool:
    """Not a zombie (orphans are reaped by init or the nearest subreaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_killing_the_launcher_saves_the_step_once_and_the_next_start_cleans_up(tmp_path):
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    proc = _start(LONG, out, tmp)
    _wait_for_steps(proc, lambda: out, steps=2)
    assert len(_ranks(proc.pid)) == 2
    os.kill(proc.pid, signal.SIGKILL)
    stdout, stderr = _finish(proc)
    last = _rows(out)[-1]["step"]
    root = out / "checkpoints"
    assert (root / "latest").read_text() == f"step_{last:08d}", stdout[-2000:] + stderr[-2000:]
    assert store.verify(root / f"step_{last:08d}") == []
    assert f"moezero: preempted after step {last} (the launcher died)" in stdout, stderr[-2000:]
    assert len(_rdzv(tmp)) == 1  # the dead launcher's; its ranks are gone
    proc = _start([*TINY, "--set", f"train.steps={last + 1}", "--set", "checkpoint.load=latest"],
                  out, tmp)
    stdout, stderr = _finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"at step {last}" in stdout
    assert _rdzv(tmp) == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_stopped_rank_is_named_in_one_line(tmp_path, sig):
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    proc = _start([*LONG, "--set", "dist.heartbeat_s=3"], out, tmp)
    _wait_for_steps(proc, lambda: out, steps=2)
    ranks = _ranks(proc.pid)
    os.kill(ranks[1], sig)
    start = time.monotonic()
    stdout, stderr = _finish(proc, timeout=120)
    assert proc.returncode == FAILED_EXIT, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    cause = "died (signal SIGKILL)" if sig == signal.SIGKILL else "no heartbeat for"
    assert lines[0].startswith(f"moezero: error: rank 1: {cause}"), lines[0]
    assert lines[0].endswith(f"(log: {out / 'logs' / 'rank1.log'})"), lines[0]
    assert cause in (out / "logs" / "rank1.log").read_text()
    assert time.monotonic() - start < 60  # not dist.timeout_s (300 s)
    assert _rdzv(tmp) == []


def test_a_pause_of_the_whole_job_is_not_a_hung_rank(tmp_path):
    """SIGSTOP of the whole process group (Ctrl-Z, ``docker pause``) for longer than
    ``dist.heartbeat_s``, then SIGCONT: the run goes on (it was killed as a hung rank before;
    issue 38, item 7)."""
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    proc = _start([*LONG, "--set", "dist.heartbeat_s=5"], out, tmp)
    _wait_for_steps(proc, lambda: out, steps=2)
    os.killpg(proc.pid, signal.SIGSTOP)
    time.sleep(8.0)
    paused = len(_rows(out))
    os.killpg(proc.pid, signal.SIGCONT)
    _wait_for_steps(proc, lambda: out, steps=paused + 3, timeout=60)
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = _finish(proc)
    assert proc.returncode == PREEMPTED_EXIT, stderr[-3000:]
    assert "no heartbeat" not in stderr, stderr[-3000:]
    assert _rdzv(tmp) == []  # the rendezvous folder is removed after a preemption too
