"""The ``train.deterministic`` switch (moezero.model.determinism): what it sets on CUDA, that
it leaves CPU runs and disabled runs alone, and (on a GPU) that two runs agree bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from moezero import cli
from moezero.config import Config, ConfigError
from moezero.model import determinism
from moezero.model.build import build_decoder
from moezero.model.decoder import Decoder, ModelArgs
from moezero.model.materialize import KeyedInit
from tests.support.fake_cuda import fake_gpus

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
        "--set", "model.ffn_dim=32", "--set", "moe.num_experts=4", "--set", "train.seq_len=16",
        "--set", "train.micro_batch_size=2", "--set", "moe.ep_size=1"]


@pytest.fixture
def torch_flags(monkeypatch):
    """Restore torch's global flags and CUBLAS_WORKSPACE_CONFIG after the test."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1:]


def test_config_key_defaults_off_and_validates():
    assert Config().train.deterministic is False
    assert Config.model_validate({"train": {"deterministic": True}}).train.deterministic
    with pytest.raises(ValueError, match="deterministic"):
        Config.model_validate({"train": {"deterministic": "sometimes"}})


def test_cuda_switch_sets_deterministic_kernels(torch_flags, monkeypatch):
    # The flags are process-wide torch settings: settable (and so testable) without a GPU.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # no cuBLAS handle yet
    torch.backends.cudnn.benchmark = True
    determinism.configure(True, torch.device("cuda"))
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == determinism.CUBLAS_WORKSPACE


@pytest.mark.parametrize("enabled, device", [(True, "cpu"), (False, "cuda"), (False, "cpu")])
def test_cpu_or_disabled_leaves_torch_alone(torch_flags, enabled, device):
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    determinism.configure(enabled, torch.device(device))
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark


def _grads(model: Decoder, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model.loss(batch)[0].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_cuda_deterministic_runs_agree_bit_for_bit(torch_flags, monkeypatch, capacity_factor):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", determinism.CUBLAS_WORKSPACE)  # CUDA ran
    determinism.configure(True, torch.device("cuda"))
    args = ModelArgs(dim=128, n_layers=2, n_heads=4, ffn_dim=256, num_experts=8,
                     capacity_factor=capacity_factor)
    model = build_decoder(args, where="cpu", init=KeyedInit(seed=0))
    model = model.to("cuda", torch.bfloat16)
    batch = torch.randint(0, args.vocab_size, (4, 257), generator=torch.Generator().manual_seed(0))
    first, second = (_grads(model, batch.cuda()) for _ in range(2))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[n], second[n]) for n in first)


def test_cuda_switch_refuses_once_cublas_may_have_run(torch_flags, monkeypatch):
    """Issue 29 item 8: CUDA started (a GEMM may have made a cuBLAS handle) and
    CUBLAS_WORKSPACE_CONFIG unset: setting it now is too late, so refuse in one line (the old
    engine set it anyway, and every later matmul raised in deterministic mode)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    torch.use_deterministic_algorithms(False)
    with pytest.raises(ConfigError, match=r"^train.deterministic: CUBLAS_WORKSPACE_CONFIG is "
                                          r"unset and CUDA already ran") as info:
        determinism.configure(True, torch.device("cuda"))
    assert "\n" not in str(info.value) and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("value,started,ok", [
    (":4096:8", True, True), (":16:8", True, True), (None, False, True),
    (None, True, False), (":0:0", False, False),
])
def test_workspace_rule(value, started, ok):
    assert (determinism.workspace_problem(value, started) is None) is ok


def test_train_exports_the_workspace_before_ranks_start(torch_flags, monkeypatch, tmp_path):
    """Spawned ranks inherit the variable, so cuBLAS sees it at its first handle (old code:
    unset at launch)."""
    fake_gpus(monkeypatch, 1)
    seen = {}
    monkeypatch.setattr("moezero.train.launch", lambda *a, **k: seen.update(
        env=os.environ.get("CUBLAS_WORKSPACE_CONFIG")) or 0)
    assert cli.main(["train", *TINY, "--set", "train.deterministic=true",
                     "--out", str(tmp_path / "run")]) == 0
    assert seen == {"env": determinism.CUBLAS_WORKSPACE}
