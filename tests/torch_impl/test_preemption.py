"""Preemption (issue 15, item 3): SIGTERM or SIGUSR1 to the launcher, to torchrun or to any one
rank makes every rank finish its current step, save a checkpoint and exit with code 75
(``PREEMPTED_EXIT``); a second signal aborts at once (128 + the signal). With async saves and
with NVMe-resident state. The checkpoint is the last step in ``metrics.jsonl`` and resumes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from moezero.distributed.signals import PREEMPTED_EXIT, PreemptOptions, StopRequest
from moezero.plan import store
from tests.support.hooked_cli import hooked
from tests.support.world import run_world
from tests.torch_impl.test_checkpoint_cli import _ranks
from tests.torch_impl.test_cli import TINY, moezero

LONG = [*TINY, "--set", "train.steps=100000"]
NVME = ["--set", "zero_optimization.stage=3",
        "--set", "zero_optimization.offload_optimizer.device=nvme",
        "--set", "zero_optimization.offload_param.device=nvme"]


# ---------------------------------------------------------------------------- in process
def test_first_signal_asks_to_stop_and_restores_the_default_action():
    stop = StopRequest(PreemptOptions((signal.SIGUSR2,)))
    before = signal.getsignal(signal.SIGUSR2)
    stop.install()
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.requested and stop.signal == signal.SIGUSR2
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL  # a second one ends it
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == before


def test_preempt_signals_come_from_the_config():
    assert PreemptOptions.from_names(["SIGTERM", "SIGUSR1"]).signals == (
        signal.SIGTERM, signal.SIGUSR1)
    assert PreemptOptions.from_names([]).signals == ()


def _agree_when_rank_1_is_signalled() -> list[bool]:
    stop = StopRequest(PreemptOptions((signal.SIGUSR2,))).install()
    seen = [stop.agree()]
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGUSR2)
    dist.barrier()
    seen.append(stop.agree())
    stop.uninstall()
    return seen


def test_every_rank_agrees_when_one_rank_is_signalled(tmp_path):
    assert run_world(_agree_when_rank_1_is_signalled, 2, tmp_path, timeout_s=60) == [
        [False, True], [False, True]]


# ---------------------------------------------------------------------------- the CLI
def _start(args: list[str], out: Path | None, *, torchrun: bool = False, env=None, cwd=None,
           cli: list[str] | None = None):
    head = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
             "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "-m", "moezero.cli"]
            if torchrun else cli or [sys.executable, "-m", "moezero.cli"])
    tail = ["--out", str(out)] if out is not None else []
    return subprocess.Popen([*head, "train", *args, *tail], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env, cwd=cwd)


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def _wait_for_steps(proc, out_of, steps: int = 2, timeout: float = 180) -> None:
    """Until ``out_of()``'s metrics have ``steps`` rows (the ranks are in their loop)."""
    deadline = time.monotonic() + timeout
    while True:
        out = out_of()
        if out is not None and len(_rows(out)) >= steps:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(proc.communicate()[0][-3000:])
        time.sleep(0.2)


def _finish(proc, timeout: float = 120) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def _check_saved_at_last_step(out: Path, output: str) -> int:
    """The committed checkpoint is the last step in metrics.jsonl, verified; returns it."""
    last = _rows(out)[-1]["step"]
    root = out / "checkpoints"
    assert (root / "latest").read_text() == f"step_{last:08d}", output[-3000:]
    assert store.verify(root / f"step_{last:08d}") == []
    assert f"moezero: preempted after step {last}" in output, output[-3000:]
    assert not list(root.glob("*.partial"))
    return last


def test_sigterm_to_the_launcher_saves_async_and_resumes(tmp_path):
    """Periodic saves are far away (every 1000 steps of 100000): the only checkpoint can come
    from the signal. It is the step the signal interrupted or the next one, the only one on
    disk, and rank 0 reports the preemption path."""
    out = tmp_path / "run"
    proc = _start([*LONG, "--set", "checkpoint.every=1000", "--set", "checkpoint.async=true"],
                  out)
    _wait_for_steps(proc, lambda: out, steps=4)
    seen = _rows(out)[-1]["step"]
    os.kill(proc.pid, signal.SIGTERM)
    output = _finish(proc)
    assert proc.returncode == PREEMPTED_EXIT, output[-3000:]
    last = _check_saved_at_last_step(out, output)
    # the step running at the signal, or the one just ended if its agreement had not run yet
    assert seen <= last <= seen + 1, (seen, last)
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [f"step_{last:08d}"]
    assert f"preempted after step {last} (a signal to the launcher)" in output, output[-3000:]
    res = moezero("train", *TINY, "--set", f"train.steps={last + 2}",
                  "--set", "checkpoint.load=latest", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"at step {last}" in res.stdout
    assert [r["step"] for r in _rows(out)] == list(range(1, last + 3))


def test_sigusr1_to_one_rank_stops_every_rank_with_nvme_state(tmp_path):
    out, swap = tmp_path / "run", tmp_path / "nvme"
    swap.mkdir()
    paths = [f"zero_optimization.offload_{k}.nvme_path={swap}" for k in ("optimizer", "param")]
    proc = _start([*LONG, *NVME, "--set", paths[0], "--set", paths[1]], out)
    _wait_for_steps(proc, lambda: out)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGUSR1)
    output = _finish(proc)
    assert proc.returncode == PREEMPTED_EXIT, output[-3000:]
    _check_saved_at_last_step(out, output)
    assert list(swap.iterdir()) == []  # a clean exit: the swap files are gone


def test_sigterm_to_torchrun_saves_in_rank_0s_run_directory(tmp_path):
    """torchrun forwards SIGTERM to its workers; without --out every worker still writes
    into the one run directory rank 0 picked."""
    runs = tmp_path / "runs"
    proc = _start(LONG, None, torchrun=True, cwd=tmp_path)
    found = lambda: next(iter(sorted(runs.iterdir())), None) if runs.is_dir() else None
    _wait_for_steps(proc, found)
    os.kill(proc.pid, signal.SIGTERM)
    output = _finish(proc)
    assert len(list(runs.iterdir())) == 1, output[-3000:]
    _check_saved_at_last_step(found(), output)  # torchrun itself then reports the signal


def test_a_second_signal_aborts_at_once(tmp_path):
    """The preemption save is slowed down (2 s before each write); the second SIGTERM lands
    inside it: every process is gone within seconds, exit 143, no checkpoint committed."""
    out = tmp_path / "run"
    proc = _start(LONG, out, cli=hooked(save_delay=2))
    _wait_for_steps(proc, lambda: out)
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not list((out / "checkpoints").glob("*.partial")) if (out / "checkpoints").exists() \
            else True:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    start = time.monotonic()
    output = _finish(proc, timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert time.monotonic() - start < 10, output[-3000:]
    assert "aborted at once" in output
    assert store.find_latest(out / "checkpoints") is None


@pytest.mark.parametrize("names", [["SIGKILL"], ["SIGINT"]])
def test_uncatchable_or_interrupt_signals_are_refused(tmp_path, names):
    res = moezero("train", "--set", f"train.preempt_signals={json.dumps(names)}",
                  "--out", str(tmp_path / "r"), timeout=60)
    assert res.returncode == 2 and "train.preempt_signals" in res.stderr, res.stderr
