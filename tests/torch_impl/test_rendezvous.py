"""In-process pieces of issue 25, items 2 and 5: the parent-death signal, stale rendezvous
folders, heartbeats, and error lines that point to the log of the rank they name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moezero.distributed import rendezvous
from moezero.distributed.failures import RankFailure, rank_errors
from moezero.distributed.heartbeat import Beat, Pulse
from moezero.distributed.signals import PARENT_DEATH_SIGNAL, PreemptOptions, StopRequest


def test_a_repeated_parent_death_signal_asks_once_and_never_aborts():
    """The kernel sends the parent-death signal once per thread of the dead launcher: every
    delivery only asks for the save; the preemption signals keep their handlers."""
    stop = StopRequest(PreemptOptions((signal.SIGUSR2,))).install(parent_death=True)
    try:
        for _ in range(3):
            os.kill(os.getpid(), PARENT_DEATH_SIGNAL)
        assert stop.requested and stop.orphaned and stop.reason == "the launcher died"
        assert signal.getsignal(signal.SIGUSR2) == stop._on_signal  # not reset to SIG_DFL
        assert signal.getsignal(PARENT_DEATH_SIGNAL) == stop._on_parent_death
    finally:
        stop.uninstall()


def _holder(path: Path) -> subprocess.Popen:
    """A process holding ``path``'s lock, as a live job's launcher or rank does."""
    code = ("import sys, time; from moezero.distributed import rendezvous; "
            "lock = rendezvous.hold(sys.argv[1]); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_stale_rendezvous_folders_are_removed_and_live_ones_kept(tmp_path):
    dead, live, fresh = (tmp_path / f"{rendezvous.PREFIX}{n}" for n in ("dead", "live", "new"))
    for path in (dead, live, fresh):
        path.mkdir()
    (dead / "store").write_text("x")
    rendezvous.hold(dead).close()  # its owner is gone
    other = tmp_path / "not-ours"
    other.mkdir()
    holder = _holder(live)
    try:
        assert rendezvous.remove_stale(tmp_path) == [dead]
        assert live.is_dir() and fresh.is_dir() and other.is_dir() and not dead.exists()
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert rendezvous.remove_stale(tmp_path) == [live]  # once its holder died
    old = time.time() - rendezvous.UNLOCKED_AGE_S - 1
    os.utime(fresh, (old, old))  # a folder without a lock (an older version's), a day old
    assert rendezvous.remove_stale(tmp_path) == [fresh]


def test_the_rendezvous_folder_is_removed_when_its_body_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    with pytest.raises(KeyboardInterrupt), rendezvous.folder() as path:
        assert path.parent == tmp_path
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_a_rank_that_stops_beating_is_named(tmp_path):
    Beat(tmp_path, 0, heartbeat_s=0.3).start()
    (tmp_path / "heartbeat-1").touch()
    pulse = Pulse(tmp_path, heartbeat_s=0.3, startup_s=5.0)
    assert pulse.silent([0, 1, 2]) is None  # rank 2 has not started beating: startup_s
    time.sleep(0.6)
    rank, age = pulse.silent([0, 1, 2])
    assert rank == 1 and age > 0.3


def test_a_pause_of_the_whole_job_is_not_a_hang(tmp_path):
    """The launcher stopped with its ranks (Ctrl-Z, ``docker pause``, a sleeping laptop): at
    its first look after the resume every beat is as old as the pause; the counts restart
    there instead, and a rank that then stays silent is still named (issue 38, item 7)."""
    now = [1000.0]
    for rank in (0, 1):
        (tmp_path / f"heartbeat-{rank}").touch()
        os.utime(tmp_path / f"heartbeat-{rank}", (now[0], now[0]))
    pulse = Pulse(tmp_path, heartbeat_s=3.0, startup_s=30.0, clock=lambda: now[0])
    assert pulse.silent([0, 1]) is None
    now[0] += 5.0  # every process of the job stopped for 5 s
    assert pulse.silent([0, 1]) is None
    found = []
    for _ in range(8):  # the launcher looks every 0.5 s; rank 0 beats, rank 1 does not
        now[0] += 0.5
        os.utime(tmp_path / "heartbeat-0", (now[0], now[0]))
        found.append(pulse.silent([0, 1]))
    assert found[:6] == [None] * 6 and found[-1] is not None, found
    assert found[-1][0] == 1 and 3.0 < found[-1][1] <= 4.0, found


def test_a_rank_still_starting_gets_startup_s_not_heartbeat_s(tmp_path):
    """A rank without a beat file yet (still importing) is named only after ``startup_s``;
    every beating rank after ``heartbeat_s`` (issue 38: removing the startup grace was caught
    only because ranks start slowly under load)."""
    now = [1000.0]
    (tmp_path / "heartbeat-0").touch()
    pulse = Pulse(tmp_path, heartbeat_s=3.0, startup_s=20.0, clock=lambda: now[0])
    found = []
    while now[0] < 1025.0:  # rank 0 beats every second, rank 1 never starts
        now[0] += 0.5
        os.utime(tmp_path / "heartbeat-0", (now[0], now[0]))
        found.append((now[0] - 1000.0, pulse.silent([0, 1])))
    first = next((t, s) for t, s in found if s is not None)
    assert first[0] == 20.5 and first[1] == (1, 20.5), found


@pytest.mark.parametrize(("text", "named"), [("disk full", 1), ("rank 0: disk full", 0)])
def test_an_error_line_points_to_the_log_of_the_rank_it_names(tmp_path, text, named):
    """An error agreed over a group names the rank it happened on: the line on rank 1 points
    to that rank's log (which that rank writes too), not to its own."""
    with pytest.raises(RankFailure) as info, rank_errors(1, tmp_path, (ValueError,)):
        raise ValueError(text)
    line = str(info.value)
    assert line.startswith(f"rank {named}: disk full"), line
    assert line.endswith(f"(traceback: {tmp_path / f'rank{named}.log'})"), line
    assert "ValueError" in (tmp_path / "rank1.log").read_text()
