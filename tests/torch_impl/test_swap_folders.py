"""Exclusive swap folders (issue 15, item 2): a job holds an ``flock`` on each swap folder it
uses for its lifetime; a second job on the same ``nvme_path`` gets a folder of its own before
its first step and never touches the first one's files; a dead job's folder (lock free) is
taken over, its stale swap files removed; the free-space check counts only space this job may
use. Swap names are injective over an adversarial alphabet.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moezero.config import ConfigError
from moezero.offload import swapdir
from moezero.offload.aio import ALIGN
from moezero.offload.swapdir import SwapDir, swap_name
from tests.torch_impl.test_offload import _decode
from tests.torch_impl.test_zero import engine_and_batches, zcfg


def nvme_cfg(path: Path) -> dict:
    cfg = zcfg(stage=2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(path)}
    return cfg


def _step(job) -> float:
    engine, _, batches = job
    return engine.train_step([torch.from_numpy(batches.next())])["loss"]


def _params(job) -> dict:
    return {k: p.detach().clone() for k, p in job[0].params.items()}


def _swap_folders(root: Path) -> list[str]:
    base = root / "moezero-swap"
    return sorted(p.name for p in base.iterdir()) if base.is_dir() else []


def test_two_jobs_on_one_nvme_path_never_share_swap_files(tmp_path):
    """Two engines (jobs) on one path, stepping in turn; the first exits cleanly mid-way. Each
    gets its own folder and both train exactly as a job alone does."""
    (tmp_path / "solo").mkdir()
    solo = engine_and_batches(nvme_cfg(tmp_path / "solo"), 1)
    want = [_step(solo) for _ in range(3)]
    want_params = _params(solo)
    solo[0].close()
    shared = tmp_path / "shared"
    shared.mkdir()
    a, b = (engine_and_batches(nvme_cfg(shared), 1) for _ in range(2))
    folders = {a[0].optimizer.optim_swap.folder.folder, b[0].optimizer.optim_swap.folder.folder}
    assert len(folders) == 2 and len(_swap_folders(shared)) == 2
    got = {"a": [], "b": []}
    for step in range(3):
        got["a"].append(_step(a))
        if step == 2:
            a_params = _params(a)
            a[0].close()  # its clean exit removes its files only
        got["b"].append(_step(b))
    assert got == {"a": want, "b": want}
    for params in (a_params, _params(b)):
        assert all(torch.equal(params[k], v) for k, v in want_params.items())
    b[0].close()
    assert _swap_folders(shared) == []


def test_a_dead_jobs_folder_is_taken_over_and_its_stale_files_removed(tmp_path):
    stale = tmp_path / "moezero-swap" / "rank00000"
    stale.mkdir(parents=True)
    (stale / "old__group__0.master.swap").write_bytes(bytes(64 * ALIGN))
    (stale / "notes.txt").write_text("not ours")
    job = engine_and_batches(nvme_cfg(tmp_path), 1)
    swap = job[0].optimizer.optim_swap.folder
    assert swap.folder == stale  # the lock was free: the folder is taken over
    names = {name for name, _ in swap.listing()}
    assert "old__group__0.master.swap" not in names and "notes.txt" in names
    _step(job)
    job[0].close()
    assert sorted(p.name for p in stale.iterdir()) == ["notes.txt"]


HOLD = ("import sys, time; from moezero.offload.swapdir import SwapDir; "
        "s = SwapDir(sys.argv[1], 0); s.allocate('g/0', 'master', 40 * 4096); "
        "print(s.folder, flush=True); time.sleep(120)")


def test_a_folder_held_by_a_live_process_is_skipped_then_reused_after_it_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        held = Path(holder.stdout.readline().strip())
        mine = SwapDir(tmp_path, 0)
        mine.allocate("g/0", "master", 4096)
        assert mine.folder != held and held.name == "rank00000"
        assert (held / swap_name("g/0", "master")).stat().st_size == 40 * 4096  # untouched
        mine.cleanup()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    again = SwapDir(tmp_path, 0)
    again.allocate("g/0", "master", 4096)
    assert again.folder == held
    again.cleanup()


def test_free_space_check_counts_only_space_this_job_may_use(tmp_path, monkeypatch):
    """A live job's swap files are not free space for another job (nor for the CLI's
    check before start); this job's own files are."""
    live = SwapDir(tmp_path, 0)
    live.allocate("g", "master", 40 * ALIGN)  # held by this live SwapDir
    usage = swapdir.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(swapdir.shutil, "disk_usage", lambda p: usage._replace(free=10 * ALIGN))
    with pytest.raises(ConfigError, match=f"need {20 * ALIGN} bytes .* only {10 * ALIGN} "):
        SwapDir(tmp_path, 0).check(20 * ALIGN)
    live.check(50 * ALIGN)  # its own files will be overwritten: they count
    live.release()  # as if its job died: now the files are reclaimable
    SwapDir(tmp_path, 0).check(50 * ALIGN)


def test_held_folders_beyond_the_limit_are_a_one_line_refusal(tmp_path, monkeypatch):
    monkeypatch.setattr(swapdir, "MAX_FOLDERS", 2)
    held = [SwapDir(tmp_path, 0).acquire() for _ in range(2)]
    with pytest.raises(swapdir.OffloadIOError, match=r"moezero-swap: all 2 swap folders of rank 0 are in use by running jobs$"):
        SwapDir(tmp_path, 0).acquire()
    for s in held:
        s.cleanup()
    assert not (tmp_path / "moezero-swap").exists()


# ---------------------------------------------------------------- swap names
ADVERSARIAL = st.text(st.sampled_from("a_/%.+"), min_size=1, max_size=24)


@settings(max_examples=500, deadline=None)
@given(ADVERSARIAL, ADVERSARIAL)
@example("a_/b", "a/_b")
@example("a__b", "a/b")
@example("_/", "/_")
@example("a%5Fb", "a_b")
def test_swap_names_of_different_groups_differ(x, y):
    if x != y:
        assert swap_name(x, "master") != swap_name(y, "master"), (x, y)


@settings(max_examples=500, deadline=None)
@given(ADVERSARIAL)
@example("a_/b")
@example("a/_b")
@example("__/__")
def test_swap_names_decode_to_their_group(name):
    enc = swap_name(name, "exp_avg")[:-len(".exp_avg.swap")]
    assert _decode(enc) == name



def test_a_job_that_loses_the_race_for_space_leaves_no_swap_folder(tmp_path, monkeypatch):
    """The space check passed, then another job took the space: reserving the second swap
    file fails (issue 25, item 7). The failed start removes its folder, lock and files."""
    calls = []
    real = swapdir._reserve

    def race(fd, size, path):
        calls.append(path)
        if len(calls) == 2:
            raise swapdir.OffloadIOError(f"{path}: cannot reserve {size} bytes: No space left "
                                         "on device")
        real(fd, size, path)

    monkeypatch.setattr(swapdir, "_reserve", race)
    with pytest.raises(swapdir.OffloadIOError, match="No space left on device"):
        engine_and_batches(nvme_cfg(tmp_path), 1)
    assert len(calls) == 2 and _swap_folders(tmp_path) == []


def test_a_job_whose_resume_fails_leaves_no_swap_folder(tmp_path):
    """The swap files are allocated, then the checkpoint to resume cannot be read: the run
    ends (one line) and its swap folder is gone."""
    from moezero.checkpoint.core import CheckpointError
    from moezero.config import Config
    from moezero.train import train

    cfg = Config.model_validate(nvme_cfg(tmp_path / "nvme"))
    (tmp_path / "nvme").mkdir()
    cfg.checkpoint.load = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(CheckpointError):
        train(cfg, tmp_path / "run")
    assert _swap_folders(tmp_path / "nvme") == []
