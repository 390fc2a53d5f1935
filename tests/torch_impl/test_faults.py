"""Clean failures (issue 15, items 4 and 5): an expected error on any rank (disk full, a path
that is not a directory, a damaged checkpoint) ends ``moezero train`` with one line naming the
rank, the path and the cause, exit code 2, and the traceback in ``<run>/logs/rank<r>.log``; a
failed save removes its ``.partial`` directory and leaves ``latest`` alone; every rank writes
into rank 0's run directory. Faults are injected through a save writer in the I/O options
(``tests.support.faulty_save.faulty_io(enospc=...)``, passed to ``setup``, or to the CLI by
``tests.support.hooked_cli``), a regular file where a directory
should be, flipped bytes, or a writer that raises.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import moezero.checkpoint.writer as cw
from moezero.checkpoint.core import CheckpointError
from moezero.config import Config
from moezero.distributed.launcher import spawn
from moezero.offload.options import IOOptions
from moezero.plan import store
from moezero.train import _train_rank, setup
from tests.support.faulty_save import faulty_io
from tests.support.hooked_cli import hooked
from tests.support.world import run_world
from tests.torch_impl.test_checkpoint import ccfg
from tests.torch_impl.test_cli import TINY, moezero


def _one_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    return lines[0]


def _step(root: Path) -> str | None:
    found = store.find_latest(root)
    return None if found is None else found.name


# ---------------------------------------------------------------------------- in process
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_a_failed_save_removes_its_partial_and_keeps_latest(tmp_path, monkeypatch, code):
    """The second save's writes fail (disk full, permission): one-line CheckpointError naming
    the file and the cause, no ``.partial`` left, ``latest`` still the first save."""
    cfg = Config.model_validate(ccfg(world=1, stage=2))
    engine, batches = setup(cfg, torch.device("cpu"), IOOptions(direct_min_bytes=0))
    engine.train_step([torch.from_numpy(batches.next())])
    engine.save_checkpoint(tmp_path)
    engine.train_step([torch.from_numpy(batches.next())])

    def full(self, path, offset, array):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(cw.RangeWriter, "__call__", full)
    monkeypatch.setattr(store, "write_range", lambda path, offset, array: full(None, path, 0, 0))
    with pytest.raises(CheckpointError) as err:
        engine.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    assert _step(tmp_path) == "step_00000001" and store.verify(tmp_path / "step_00000001") == []
    message = str(err.value)
    assert "\n" not in message and os.strerror(code) in message, message
    assert re.search(r"step_00000002\.partial/\S+\.safetensors: ", message), message


def test_a_failed_latest_after_the_commit_names_latest_and_leaves_no_tmp(tmp_path,
                                                                         monkeypatch):
    """issue 38 #8: the disk fills while ``latest`` is replaced, after step 2 was renamed into
    place: the line names ``latest`` and says step 2 is committed (not ``step_2.partial``), and
    no ``latest.tmp`` is left; ``latest`` still names step 1."""
    import moezero.plan.stepdirs as stepdirs

    cfg = Config.model_validate(ccfg(world=1, stage=2))
    engine, batches = setup(cfg, torch.device("cpu"), IOOptions(direct_min_bytes=0))
    engine.train_step([torch.from_numpy(batches.next())])
    engine.save_checkpoint(tmp_path)
    engine.train_step([torch.from_numpy(batches.next())])
    real = stepdirs.fsync_file

    def full(path):
        if Path(path).name == "latest.tmp":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path)

    monkeypatch.setattr(stepdirs, "fsync_file", full)
    with pytest.raises(CheckpointError) as err:
        engine.save_checkpoint(tmp_path)
    message = str(err.value)
    assert "\n" not in message and ".partial" not in message, message
    assert f"{tmp_path / 'latest'}: {os.strerror(errno.ENOSPC)}" in message, message
    assert "step_00000002 is committed" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001",
                                                          "step_00000002"]
    assert _step(tmp_path) == "step_00000001"


def test_injected_enospc_fails_only_its_rank_and_step(tmp_path):
    """``faulty_io(enospc=(rank, step))``: the fault the CLI tests use."""
    cfg = Config.model_validate(ccfg(world=1, stage=2))
    engine, batches = setup(cfg, torch.device("cpu"), faulty_io(enospc=(0, 2)))
    for step in (1, 2, 3):
        engine.train_step([torch.from_numpy(batches.next())])
        if step == 2:
            with pytest.raises(CheckpointError, match="rank 0: .*No space left on device"):
                engine.save_checkpoint(tmp_path)
        else:
            engine.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001",
                                                          "step_00000003"]


def test_save_faults_reach_the_save_only_through_its_writer():
    """Issue 35 item 5: no production signature carries a fault-hook parameter; a test's
    faults travel as the I/O options' ``save_writer`` (the seam every save writes through)."""
    import inspect

    from moezero import cli, engine, train
    from moezero.checkpoint import core, save

    for fn in (cli.main, train.launch_training, train._train_rank, train.train, train.setup,
               engine.initialize, engine.Engine.__init__, core.Checkpointer.__init__,
               save.write):
        assert "hooks" not in inspect.signature(fn).parameters, fn.__qualname__
    assert IOOptions().save_writer is None  # a run writes through checkpoint.writer.SaveWriter
    assert isinstance(faulty_io(delay_s=1).save_writer(IOOptions(), set(), rank=0, step=1),
                      cw.SaveWriter)


# ---------------------------------------------------------------------------- one run dir
def _rank_with_its_own_dir(cfg_data: dict, tmp: str) -> None:
    """Each rank proposes its own run directory, as torchrun workers without --out do."""
    import torch.distributed as dist

    _train_rank(cfg_data, f"{tmp}/run{dist.get_rank()}")


def test_every_rank_writes_into_rank_0s_run_directory(tmp_path):
    cfg = Config.model_validate(ccfg(world=2, stage=2, ep=2))
    cfg.train.steps, cfg.checkpoint.every = 2, 1
    run_world(_rank_with_its_own_dir, 2, tmp_path / "world", cfg.model_dump(by_alias=True),
              str(tmp_path))
    assert not (tmp_path / "run1").exists()
    assert len((tmp_path / "run0" / "metrics.jsonl").read_text().splitlines()) == 2
    assert _step(tmp_path / "run0" / "checkpoints") == "step_00000002"
    assert store.verify(tmp_path / "run0" / "checkpoints" / "step_00000002") == []


# ---------------------------------------------------------------------------- the CLI
def test_disk_full_on_one_rank_is_one_line_and_latest_survives(tmp_path):
    out = tmp_path / "run"
    res = subprocess.run([*hooked(enospc="1:4"), "train", *TINY, "--set", "train.steps=4",
                          "--set", "checkpoint.every=2", "--out", str(out)],
                         capture_output=True, text=True, timeout=180)
    line = _one_line(res)
    assert res.returncode == 2, res.stderr
    assert line.startswith("moezero: error: checkpoint save of step 4 under ")
    assert "rank 1: " in line and "No space left on device" in line, line
    assert "step_00000004.partial/" in line and f"traceback: {out / 'logs'}" in line, line
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]
    assert _step(root) == "step_00000002" and store.verify(root / "step_00000002") == []
    logs = sorted(p.name for p in (out / "logs").iterdir())
    assert "rank1.log" in logs and "Traceback" in (out / "logs" / "rank1.log").read_text()


def test_a_path_that_is_a_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    res = moezero("train", *TINY, "--set", "train.steps=1",
                  "--set", f"checkpoint.dir={tmp_path / 'file' / 'ckpt'}",
                  "--out", str(tmp_path / "run"))
    line = _one_line(res)
    assert res.returncode == 2, res.stderr
    assert line.startswith("moezero: error: checkpoint.dir: "), line  # before any rank starts
    assert f"{tmp_path / 'file'}" in line, line
    assert "Not a directory" in line or "File exists" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_damaged_checkpoint_stops_the_run_before_its_first_step(tmp_path):
    first = tmp_path / "first"
    assert moezero("train", *TINY, "--set", "train.steps=1", "--out", str(first)).returncode == 0
    step = first / "checkpoints" / "step_00000001"
    bad = shutil.copytree(step, tmp_path / "bad" / step.name)
    record = max(store.read_manifest(bad).checksums, key=lambda r: r.length)
    data = bytearray((bad / record.file).read_bytes())
    data[record.offset + record.length // 2] ^= 0x40
    (bad / record.file).write_bytes(data)
    out = tmp_path / "run"
    res = moezero("train", *TINY, "--set", "train.steps=3", "--set", f"checkpoint.load={bad}",
                  "--out", str(out))
    line = _one_line(res)
    assert res.returncode == 2, res.stderr
    assert f"{record.file} bytes [{record.offset}, {record.offset + record.length})" in line, line
    assert "crc32" in line and "rank " in line, line
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def _fails_with_a_bug() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("a bug, not a fault")
    dist.barrier()


def test_a_crash_still_shows_its_traceback(capfd):
    """Only expected errors are shortened: a bug keeps its traceback (exit code 1)."""
    assert spawn(_fails_with_a_bug, 2, timeout_s=60) == 1
    err = capfd.readouterr().err
    assert "Traceback" in err and "a bug, not a fault" in err


def test_a_bug_in_a_save_keeps_its_traceback(tmp_path, monkeypatch, caplog):
    """A save turns every rank's exception into the one agreed line (no rank may be left in a
    collective), but an exception that is not an OS or checkpoint error is a bug: its
    traceback is logged, while a disk error (expected) logs none."""
    cfg = Config.model_validate(ccfg(world=1, stage=2))
    engine, batches = setup(cfg, torch.device("cpu"))
    engine.train_step([torch.from_numpy(batches.next())])

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    with monkeypatch.context() as patch:
        patch.setattr(store, "write_partition", broken)
        with pytest.raises(CheckpointError, match="rank 0: ZeroDivisionError: a bug"):
            engine.save_checkpoint(tmp_path / "bug")
    logged = [r for r in caplog.records if r.name == "moezero.checkpoint"]
    assert len(logged) == 1 and logged[0].exc_info[0] is ZeroDivisionError
    caplog.clear()
    engine.save_checkpoint(tmp_path / "ok")
    assert _step(tmp_path / "ok") == "step_00000001"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "x")

    monkeypatch.setattr(store, "write_partition", full)
    with pytest.raises(CheckpointError, match="No space left"):
        engine.save_checkpoint(tmp_path / "full")
    assert not [r for r in caplog.records if r.name == "moezero.checkpoint"]
