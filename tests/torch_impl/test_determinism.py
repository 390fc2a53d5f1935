"""The ``train.deterministic`` switch (moezero.model.determinism): what it sets on CUDA, that
it leaves CPU runs and disabled runs alone, and (on a GPU) that two runs agree bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from moezero.config import Config
from moezero.model import determinism
from moezero.model.decoder import Decoder, ModelArgs, init_weights


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


def test_cuda_switch_sets_deterministic_kernels(torch_flags):
    # The flags are process-wide torch settings: settable (and so testable) without a GPU.
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
def test_cuda_deterministic_runs_agree_bit_for_bit(torch_flags, capacity_factor):
    determinism.configure(True, torch.device("cuda"))
    args = ModelArgs(dim=128, n_layers=2, n_heads=4, ffn_dim=256, num_experts=8,
                     capacity_factor=capacity_factor)
    model = Decoder(args)
    init_weights(model, seed=0)
    model = model.to("cuda", torch.bfloat16)
    batch = torch.randint(0, args.vocab_size, (4, 257), generator=torch.Generator().manual_seed(0))
    first, second = (_grads(model, batch.cuda()) for _ in range(2))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[n], second[n]) for n in first)
