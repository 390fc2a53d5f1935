"""When a run saves and how a failed save is reported (issue 25, items 3 and 7):
``checkpoint.every_minutes`` saves on rank 0's clock, agreed by every rank in the per-step
agreement; a failed async save stops every rank right after it is found, naming its step and
file; a disk-full error names the file even when the failing ``pwrite`` does not.
docs/reliability.md.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch

from moezero.checkpoint.core import CheckpointError
from moezero.checkpoint.schedule import SaveClock
from moezero.config import Config
from moezero.distributed.signals import PreemptOptions, StopRequest
from moezero.offload.options import IOOptions
from moezero.plan import store
from moezero.train import setup, train
from tests.support.faulty_save import faulty_io
from tests.support.world import run_world
from tests.torch_impl.test_checkpoint import ccfg


def test_save_clock_is_due_every_interval_after_the_last_save():
    now = [100.0]
    clock = SaveClock(2, clock=lambda: now[0])
    now[0] += 119.0
    assert not clock.due()
    now[0] += 1.0
    assert clock.due()
    clock.saved()
    assert not clock.due()
    assert not SaveClock(0, clock=lambda: now[0] + 1e9).due()


def _train_saving_by_time(cfg_data: dict, run_dir: str) -> list[str]:
    train(Config.model_validate(cfg_data), Path(run_dir))
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("step_*"))


def test_time_based_saves_are_agreed_by_every_rank(tmp_path):
    """``every_minutes`` so short that every step is due on rank 0: every rank saves after
    every step (the save is collective: a rank that did not agree would hang the world)."""
    cfg = Config.model_validate(ccfg(world=2, stage=2))
    cfg.train.steps, cfg.checkpoint.every, cfg.checkpoint.keep_last = 4, 0, 10
    cfg.checkpoint.every_minutes = 1e-9
    saved = run_world(_train_saving_by_time, 2, tmp_path / "world",
                      cfg.model_dump(by_alias=True), str(tmp_path / "run"))
    assert saved[0] == [f"step_{s:08d}" for s in (1, 2, 3, 4)], saved
    for step in (1, 2, 3, 4):
        assert store.verify(tmp_path / "run" / "checkpoints" / f"step_{step:08d}") == []


def test_time_based_saves_are_on_by_default():
    assert Config().checkpoint.every_minutes == 30


def _train_until_a_save_fails(cfg_data: dict, run_dir: str) -> tuple[str, int]:
    """A run with a stop request (as the launcher gives every rank) whose rank 1 finds the
    disk full in the async save of step 10."""
    try:
        train(Config.model_validate(cfg_data), Path(run_dir),
              io=faulty_io(enospc=(1, 10)), stop=StopRequest(PreemptOptions(())))
    except CheckpointError as exc:
        rows = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        return str(exc), json.loads(rows[-1])["step"]
    return "", -1


def test_a_failed_async_save_stops_every_rank_soon_after(tmp_path):
    """The old code found the failure only at the next save (step 20) or at the end: ten
    steps on without a checkpoint, and a line that did not say when it was found."""
    cfg = Config.model_validate(ccfg(world=2, stage=2))
    cfg.train.steps, cfg.checkpoint.every, cfg.checkpoint.every_minutes = 40, 10, 0
    cfg.checkpoint.async_save = True
    results = run_world(_train_until_a_save_fails, 2, tmp_path / "world",
                        cfg.model_dump(by_alias=True), str(tmp_path / "run"))
    message, last = results[0]
    assert 10 < last < 20, (last, message)  # the old code: 20, the next save
    assert results[1][0] == message and "\n" not in message, results
    assert message.startswith("checkpoint save of step 10 under "), message
    assert "rank 1: " in message and "step_00000010.partial/" in message, message
    assert "No space left on device" in message, message
    assert re.search(r"\(an async save; found after step 1[0-9]\)$", message), message
    root = tmp_path / "run" / "checkpoints"
    assert list(root.glob("step_*")) == []  # step 10 removed, nothing before it


def test_a_disk_full_write_that_names_no_file_is_named(tmp_path, monkeypatch):
    """A real ``pwrite`` on a full disk raises ``[Errno 28] No space left on device`` with no
    file name; the save's line names the file it was writing."""
    cfg = Config.model_validate(ccfg(world=1, stage=2))
    engine, batches = setup(cfg, torch.device("cpu"), IOOptions(direct_io=False))
    engine.train_step([torch.from_numpy(batches.next())])
    real = store.pwrite_all

    def full(fd, data, offset):
        if offset > 0:  # the data ranges; headers (offset 0) go through
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(store, "pwrite_all", full)
    with pytest.raises(CheckpointError) as err:
        engine.save_checkpoint(tmp_path)
    message = str(err.value)
    assert re.search(r"rank 0: \S+/step_00000001\.partial/\S+\.safetensors: No space left on "
                     r"device$", message), message
