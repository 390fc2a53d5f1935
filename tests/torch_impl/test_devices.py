"""Rank -> device placement on a GPU machine, with the CUDA facts faked (issue 29, item 1).

The launcher used to ``set_device(local_rank)`` in every rank whenever CUDA existed: rank 1
of the default ``moezero train`` (2 ranks) died on a one-GPU machine, and so did every W >= 2
gloo test. ``moezero.distributed.devices`` decides instead; these tests run on CPU.
"""

from __future__ import annotations

import pytest
import torch

from moezero import cli
from moezero.distributed import launcher
from moezero.distributed.devices import DeviceError, place_rank, plan_devices, rank_device
from tests.support.fake_cuda import fake_gpus, fake_launch

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
        "--set", "model.ffn_dim=32", "--set", "moe.num_experts=4", "--set", "train.seq_len=16",
        "--set", "train.micro_batch_size=2"]


@pytest.mark.parametrize("nproc,backend,count,visible,backend_out,devices", [
    (2, "auto", 0, None, "gloo", ("cpu", "cpu")),
    (2, "gloo", 4, None, "gloo", ("cpu", "cpu")),  # gloo on a GPU box keeps tensors on the host
    (1, "auto", 1, None, "nccl", ("cuda:0",)),
    (4, "auto", 4, None, "nccl", ("cuda:0", "cuda:1", "cuda:2", "cuda:3")),
    (2, "nccl", 8, None, "nccl", ("cuda:0", "cuda:1")),
    # torchrun with CUDA_VISIBLE_DEVICES narrowed to one device per process: each sees cuda:0
    (4, "auto", 1, "3", "nccl", ("cuda:0",) * 4),
])
def test_plan_devices_table(nproc, backend, count, visible, backend_out, devices):
    plan = plan_devices(nproc, backend, count, visible)
    assert (plan.backend, plan.devices) == (backend_out, devices)


@pytest.mark.parametrize("nproc,backend,count,visible,key", [
    (2, "auto", 1, None, "--nproc"),      # two NCCL ranks cannot share one device
    (2, "auto", 1, "0,1", "--nproc"),
    (3, "nccl", 2, None, "--nproc"),
    (1, "nccl", 0, None, "dist.backend"),
])
def test_plan_devices_refusals_name_the_option(nproc, backend, count, visible, key):
    with pytest.raises(DeviceError) as info:
        plan_devices(nproc, backend, count, visible)
    assert info.value.key == key and "\n" not in str(info.value)


@pytest.fixture
def one_gpu(monkeypatch):
    return fake_gpus(monkeypatch, 1)


def test_gloo_rank_on_a_gpu_box_never_selects_a_device(one_gpu, tmp_path):
    """Rank 1 of a gloo world on a one-GPU machine (old code: set_device(1), 'invalid device
    ordinal' on a real GPU)."""
    seen = []
    launcher._in_process_group(lambda: seen.append(1), 0, 1, f"file://{tmp_path}/store",
                               "gloo", 30.0, (), local_rank=1)
    assert seen == [1] and one_gpu == []
    assert rank_device("gloo") == torch.device("cpu")


def test_nccl_rank_takes_local_rank_modulo_devices(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    place_rank("nccl", 3)
    assert calls == [1]


@pytest.fixture
def launched(monkeypatch):
    return fake_launch(monkeypatch)


def test_default_train_on_one_gpu_gets_a_runnable_layout(one_gpu, launched, tmp_path):
    """Old code: 2 NCCL ranks on the one device (rank 1 died before writing its error)."""
    code = cli.main(["train", *TINY, "--set", "moe.ep_size=1", "--out", str(tmp_path / "run")])
    assert code == 0
    assert launched == {"nproc": 1, "backend": "nccl"}


def test_default_recipe_on_one_gpu_is_one_line(one_gpu, launched, tmp_path, capsys):
    """The embedded recipe (ep_size 2) cannot run on one rank: refused before any rank
    starts, naming the key and why W is 1."""
    assert cli.main(["train", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moezero: error: moe.ep_size:") and "one rank per CUDA device" in err
    assert "\n" not in err and launched == {}


def test_more_nccl_ranks_than_devices_is_refused(one_gpu, launched, tmp_path, capsys):
    """Old code: launched 2 NCCL ranks on one device."""
    code = cli.main(["train", *TINY, "--nproc", "2", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and launched == {}
    assert err.startswith("moezero: error: --nproc: 2 NCCL ranks need 2 CUDA devices")


def test_gloo_on_a_gpu_box_spawns_host_ranks(one_gpu, launched, tmp_path):
    code = cli.main(["train", *TINY, "--nproc", "2", "--set", "dist.backend=gloo",
                     "--out", str(tmp_path / "run")])
    assert code == 0 and launched == {"nproc": 2, "backend": "gloo"}
