"""What a run writes is checked before its first step, and one run holds its run directory
(issue 25, items 3 and 4): an unwritable ``checkpoint.dir``, one without room for a
checkpoint, or a run directory a live run holds, is one line and exit 2 before any step; a
finished run's directory can be resumed. docs/reliability.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest

from moezero.cli import main
from moezero.config import ConfigError
from tests.torch_impl.test_cli import TINY, moezero

ONE = [*TINY, "--nproc", "1", "--set", "moe.ep_size=1"]


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    return lines[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs sysfs")
def test_an_unwritable_checkpoint_dir_is_refused_before_the_first_step(tmp_path):
    """``checkpoint.dir`` on a filesystem that refuses new folders (sysfs): the old code
    trained every step and failed at the final save, losing the whole run."""
    out, ckpt = tmp_path / "run", "/sys/moezero-test-ckpt/ckpt"
    if os.path.lexists("/sys/moezero-test-ckpt"):
        pytest.skip("/sys accepted a folder here")
    res = moezero("train", *ONE, "--set", "train.steps=2",
                  "--set", f"checkpoint.dir={ckpt}", "--out", str(out))
    line = _one_line(res.stderr)
    assert res.returncode == 2, res.stderr
    assert line.startswith("moezero: error: checkpoint.dir: cannot write there: "), line
    assert "/sys/moezero-test-ckpt" in line, line
    assert not (out / "metrics.jsonl").exists() and not out.exists()


def test_too_little_space_for_a_checkpoint_is_refused_before_the_first_step(
        tmp_path, monkeypatch, capsys):
    """The checkpoint root's filesystem reports less free space than one checkpoint."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 4096))
    out = tmp_path / "run"
    code = main(["train", *ONE, "--set", "train.steps=1", "--out", str(out)])
    line = _one_line(capsys.readouterr().err)
    assert code == 2, line
    assert line.startswith("moezero: error: checkpoint.dir: one checkpoint needs "), line
    assert "only 4096 bytes" in line and str(out / "checkpoints") in line, line
    assert not (out / "metrics.jsonl").exists()


def test_room_for_keep_last_plus_one_checkpoints_is_checked(tmp_path, monkeypatch, capsys):
    """issue 38 #8: a save needs room for keep_last + 1 checkpoints while the oldest is still
    kept; with room for two (keep_last 2) the run used to pass and die at its third save."""
    from moezero.config import load_config
    from moezero.train import checkpoint_size

    one = checkpoint_size(load_config(None, [a for a in ONE if a.startswith(("model", "moe",
                                                                                 "train"))]))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 0, 2 * one + 4096))
    out = tmp_path / "run"
    code = main(["train", *ONE, "--set", "train.steps=1", "--out", str(out)])
    line = _one_line(capsys.readouterr().err)
    assert code == 2, line
    assert line.startswith(f"moezero: error: checkpoint.dir: one checkpoint needs {one} bytes"), line
    assert f"keep_last 2 + 1: {3 * one} bytes" in line and f"only {2 * one + 4096} bytes" in line
    assert not (out / "metrics.jsonl").exists()


def _metrics_rows(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_second_run_on_a_live_runs_directory_is_refused(tmp_path):
    """A run is training in ``out`` (2 spawned ranks); a second ``moezero train --out out``
    is refused in one line, writes nothing there, and the first run goes on. The old code
    let the second run truncate the first's metrics and overwrite its config."""
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "moezero.cli", "train", *TINY,
                              "--set", "train.steps=100000", "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while _metrics_rows(out) < 2:
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.2)
        config = (out / "config.yaml").read_text()
        res = moezero("train", *ONE, "--set", "train.steps=1",
                      "--set", "train.seed=7", "--out", str(out))
        line = _one_line(res.stderr)
        assert res.returncode == 2, res.stderr
        assert "--out: the run directory is in use by a running job (pid " in line, line
        assert str(out) in line, line
        assert (out / "config.yaml").read_text() == config
        rows = _metrics_rows(out)
        assert rows >= 2 and not (out / "logs").exists()
        while _metrics_rows(out) <= rows:  # the first run still trains
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.2)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)


def test_a_finished_runs_directory_can_be_resumed(tmp_path):
    out = tmp_path / "run"
    assert moezero("train", *ONE, "--set", "train.steps=1",
                   "--out", str(out)).returncode == 0
    assert not (out / ".moezero.lock").exists()  # removed at the clean finish (issue 39)
    res = moezero("train", *ONE, "--set", "train.steps=2",
                  "--set", "checkpoint.load=latest", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert _metrics_rows(out) == 2
    assert not (out / ".moezero.lock").exists()


def test_the_lock_file_is_removed_after_sigterm(tmp_path):
    """SIGTERM: the ranks save and exit 75; rank 0 removes the lock file as it lets go."""
    from moezero.distributed.signals import PREEMPTED_EXIT
    from tests.torch_impl.test_preemption import LONG, _finish, _start, _wait_for_steps

    out = tmp_path / "run"
    proc = _start(LONG, out)
    _wait_for_steps(proc, lambda: out, steps=2)
    assert (out / ".moezero.lock").read_text().startswith("pid ")
    os.kill(proc.pid, signal.SIGTERM)
    output = _finish(proc)
    assert proc.returncode == PREEMPTED_EXIT, output[-3000:]
    assert not (out / ".moezero.lock").exists(), output[-3000:]


def test_a_released_lock_file_is_removed_and_a_waiter_opens_it_anew(tmp_path):
    """A process that opened the file before the holder removed it must not lock the
    removed file (two holders): it opens the path again."""
    import fcntl

    from moezero.rundir import LOCK_NAME, RunLock

    first = RunLock(tmp_path).acquire()
    stale = os.open(tmp_path / LOCK_NAME, os.O_RDWR)  # a waiter between its open and flock
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the removed file: nobody else's
    second = RunLock(tmp_path).acquire()
    assert (tmp_path / LOCK_NAME).read_text().startswith(f"pid {os.getpid()} ")
    with pytest.raises(ConfigError, match="in use by a running job"):
        RunLock(tmp_path).acquire()
    second.release()
    os.close(stale)
    assert not (tmp_path / LOCK_NAME).exists()


def test_fault_hooks_are_not_production_options():
    """Issue 25 item 8: fault injection lives in a test's save writer
    (``tests.support.faulty_save``), passed in by tests; the I/O options carry no test fields
    and the CLI reads no test variables."""
    import dataclasses
    import inspect

    import moezero.cli
    from moezero.offload.options import IOOptions

    assert [f.name for f in dataclasses.fields(IOOptions) if f.name.startswith("test")] == []
    assert "MOEZERO_TEST" not in inspect.getsource(moezero.cli)


def test_torchrun_workers_share_one_locked_run_directory(tmp_path):
    """Under torchrun every worker runs its own CLI on the same ``--out``: only rank 0's
    checks and holds the lock, so the world does not refuse itself."""
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                          "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
                          "-m", "moezero.cli", "train", *TINY, "--set", "train.steps=2",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _metrics_rows(out) == 2
    assert not (out / ".moezero.lock").exists()  # rank 0 held it and removed it at the end


def test_ranks_refuse_a_run_directory_held_after_the_clis_check(tmp_path, capfd):
    """The lock is taken after the CLI's check (a race): rank 0 cannot lock the directory,
    the broadcast that agrees on it carries the refusal, and every rank stops before its
    first step, writing nothing there."""
    import fcntl

    from moezero.config import Config
    from moezero.distributed.launcher import spawn
    from moezero.train import _train_rank
    from tests.torch_impl.test_checkpoint import ccfg

    out = tmp_path / "run"
    out.mkdir()
    cfg = Config.model_validate(ccfg(world=2, stage=2))
    with open(out / ".moezero.lock", "w") as held:  # another run's lock, as flock(1) takes it
        held.write(f"pid {os.getpid()} on here\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        code = spawn(_train_rank, 2, (cfg.model_dump(by_alias=True), str(out)), timeout_s=60)
    err = capfd.readouterr().err
    assert code == 2, err[-3000:]
    line = _one_line(err)
    assert line.startswith("moezero: error: rank 0: --out: the run directory is in use by a "
                           f"running job (pid {os.getpid()} "), line
    assert sorted(p.name for p in out.iterdir()) == [".moezero.lock"]


def test_a_probe_survives_another_worker_removing_the_new_folder(tmp_path, monkeypatch):
    """torchrun's workers probe the same new folders at once: one removes the folders it
    created while another is between its mkdir and its probe file."""
    from moezero import rundir

    target, real_open, raced = tmp_path / "a" / "b", os.open, []

    def racing_open(path, flags, mode=0o777, **kw):
        if not raced and str(path).startswith(str(target)):
            raced.append(path)
            target.rmdir()  # the other worker's clean-up
            target.parent.rmdir()
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", racing_open)
    rundir.probe_writable(target, "checkpoint.dir")
    assert raced and not (tmp_path / "a").exists()


def _listing(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".moezero.lock"}


def test_a_lora_run_in_its_bases_run_directory_is_refused(tmp_path, capsys):
    """issue 38 #5: a LoRA run started in the --out of the full run it uses as its base would
    restart the step count at 0 in the base's checkpoint root, and its saves and keep_last
    delete the base: refused in one line before any rank starts; the base is untouched."""
    out = tmp_path / "run"
    assert moezero("train", *ONE, "--set", "train.steps=2", "--out", str(out)).returncode == 0
    before = _listing(out / "checkpoints")
    for load in ("latest", str(out / "checkpoints" / "step_00000002")):
        code = main(["train", *ONE, "--set", "train.steps=1", "--set", "peft.method=lora",
                     "--set", f"checkpoint.load={load}", "--out", str(out)])
        line = _one_line(capsys.readouterr().err)
        assert code == 2, line
        assert line.startswith(f"moezero: error: checkpoint.dir: {out / 'checkpoints'} holds "
                               f"{out / 'checkpoints' / 'step_00000002'}, the base of this LoRA "
                               "run"), line
        assert _listing(out / "checkpoints") == before
    other = tmp_path / "lora"  # its own --out: fine
    res = moezero("train", *ONE, "--set", "train.steps=1", "--set", "peft.method=lora",
                  "--set", f"checkpoint.load={out / 'checkpoints'}", "--out", str(other))
    assert res.returncode == 0, res.stderr
    assert _listing(out / "checkpoints") == before


def test_two_runs_on_one_checkpoint_dir_are_refused(tmp_path):
    """issue 38 #6: two runs with their own --out and one checkpoint.dir both died at their
    first save and left the root empty: the lock covers checkpoint.dir too; the second run is
    refused in one line, the first's checkpoints survive."""
    shared = tmp_path / "shared_ckpt"
    sets = ["--set", f"checkpoint.dir={shared}", "--set", "checkpoint.every=1"]
    first = subprocess.Popen([sys.executable, "-m", "moezero.cli", "train", *ONE, *sets,
                              "--set", "train.steps=100000", "--out", str(tmp_path / "a")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while _metrics_rows(tmp_path / "a") < 2:
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.2)
        res = moezero("train", *ONE, *sets, "--set", "train.steps=1",
                      "--out", str(tmp_path / "b"))
        line = _one_line(res.stderr)
        assert res.returncode == 2, res.stderr
        assert "checkpoint.dir: the checkpoint root is in use by a running job; give each run " \
            "its own checkpoint.dir" in line
        assert str(shared) in line, line
        rows = _metrics_rows(tmp_path / "a")
        while _metrics_rows(tmp_path / "a") <= rows:  # the first run still trains and saves
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.2)
        assert any(p.name.startswith("step_") for p in shared.iterdir())
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)


def test_a_run_into_another_runs_checkpoint_root_is_refused(tmp_path, capsys):
    """issue 38 #5, the general rule: a run writes into (and prunes) only a checkpoint root it
    creates or resumes from. A fresh run in another run's --out, a run resuming a checkpoint
    of another root there, and a run given that root as its checkpoint.dir are refused in
    one line before any rank starts; the root is untouched. Resuming from the root runs."""
    out = tmp_path / "run"
    assert moezero("train", *ONE, "--set", "train.steps=2", "--out", str(out)).returncode == 0
    root = out / "checkpoints"
    before = _listing(root)
    shutil.copytree(root, tmp_path / "copy")
    for argv in (["--out", str(out)],
                 ["--set", f"checkpoint.load={tmp_path / 'copy'}", "--out", str(out)],
                 ["--set", f"checkpoint.dir={root}", "--out", str(tmp_path / "other")]):
        code = main(["train", *ONE, "--set", "train.steps=3", *argv])
        line = _one_line(capsys.readouterr().err)
        assert code == 2, line
        assert line.startswith(f"moezero: error: checkpoint.dir: {root} holds the checkpoints "
                               "of another run (step_00000002): "), line
        assert "--set checkpoint.load=latest" in line, line
        assert _listing(root) == before
    from moezero.config import load_config
    from moezero.train import preflight

    cfg = load_config(None, [*_sets(ONE), "checkpoint.load=latest"])
    assert preflight(cfg, out) == root / "step_00000002"  # resuming it is that run
    from moezero import rundir

    rundir.check_run(out, root, 1, resumes=root / "step_00000002")


def _sets(argv: list[str]) -> list[str]:
    """The ``--set`` values of a command line."""
    return [v for k, v in zip(argv[::2], argv[1::2], strict=True) if k == "--set"]


def test_keep_last_never_removes_a_step_the_run_did_not_write(tmp_path):
    """keep_last removes only the steps this run saved or resumed from: a complete checkpoint
    of another run found in the root (planted past the CLI's check) survives every save."""
    from moezero.config import load_config
    from moezero.train import launch_training

    first = tmp_path / "first"
    assert moezero("train", *ONE, "--set", "train.steps=2", "--set", "checkpoint.every=1",
                   "--set", "checkpoint.keep_last=2", "--out", str(first)).returncode == 0
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(first / "checkpoints" / "step_00000001", root / "step_00000001")
    foreign = _listing(root)
    sets = [*_sets(ONE), "train.steps=4", "checkpoint.every=1",
            "checkpoint.keep_last=1", f"checkpoint.dir={root}",
            f"checkpoint.load={first / 'checkpoints' / 'step_00000002'}"]
    assert launch_training(load_config(None, sets), tmp_path / "second", 1) == 0
    steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    assert steps == ["step_00000001", "step_00000004"], steps
    assert {k: v for k, v in _listing(root).items() if k.startswith("step_00000001")} == foreign
