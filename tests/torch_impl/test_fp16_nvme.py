"""fp16 through ZeRO-3 with params and optimizer state on NVMe (issue 15, item 7): bit for bit
the same run as stage 2 in memory (loss scaling, overflow skips and all), and a checkpoint
saved from the swap files and loaded back into them (new processes) continues the run bit for
bit.
"""

from __future__ import annotations

import pytest

from moezero.plan import store
from tests.support.world import run_world
from tests.torch_impl.test_stage3 import _assert_same, offload_cfg, run_cases

STEPS, HALF = 8, 4


def fp16_cfg(stage: int, nvme: str | None = None) -> dict:
    device = "nvme" if nvme else "none"
    cfg = offload_cfg(stage, device if stage == 3 else "none", device, dtype="fp16", nvme=nvme)
    # a scale that overflows at first: the run skips steps and halves it (scaler state saved)
    cfg["precision"].update(initial_scale_power=24, loss_scale_window=2, hysteresis=1)
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    nvme, ckpt = tmp_path_factory.mktemp("swap"), tmp_path_factory.mktemp("ckpt")
    s3 = fp16_cfg(3, str(nvme))
    first = run_world(run_cases, 2, tmp_path_factory.mktemp("first"), {
        "s2": (fp16_cfg(2), STEPS), "s3_nvme": (s3, STEPS),
        "s3_nvme_half": (s3, HALF, 2, 0, None, str(ckpt))}, timeout_s=300)
    resumed = run_world(run_cases, 2, tmp_path_factory.mktemp("resumed"), {
        "s3_nvme_resumed": (s3, STEPS, 2, HALF, str(ckpt), None)}, timeout_s=300)
    return first, resumed, ckpt


def test_fp16_stage3_on_nvme_equals_stage2_in_memory(runs):
    first, _, _ = runs
    for rank in first:
        assert len(set(rank["s2"]["losses"])) > 1
        _assert_same(rank["s3_nvme"], rank["s2"])
        assert rank["s3_nvme"]["swap_files"] and rank["s3_nvme"]["swap_left"] == []


def test_fp16_nvme_checkpoint_round_trip_continues_bitwise(runs):
    first, resumed, ckpt = runs
    saved = store.read_manifest(ckpt / f"step_{HALF:08d}")
    assert saved.topology["zero_stage"] == 3 and saved.topology["dtype"] == "float16"
    assert saved.state["engine"]["loss_scaler"]["scale"] < 2.0**24  # overflows were skipped
    assert saved.state["engine"]["step_count"] < saved.state["engine"]["global_steps"] == HALF
    for whole, again in zip(first, resumed, strict=True):
        want = whole["s3_nvme"]
        _assert_same(again["s3_nvme_resumed"], {**want, "losses": want["losses"][HALF:]})
