"""The GPU test matrix (issue 29): what CPU runs cannot show. Every test is ``gpu``-marked and
skipped, with its reason, below the GPUs it needs; ``python -m benchmarks.gpu --check`` runs
them on a lent device.

- Two NCCL ranks: stage 2 (bucketed reduce-scatter launched from the gradient hooks) and
  stage 3 (gathers), both with the EP all-to-all at ep = 2 and one rank receiving zero rows,
  equal to the same run on two gloo CPU ranks.
- One MoE layer with the expert-bias router under ``set_sync_debug_mode("error")`` (the
  router's loads once used ``bincount``, a host sync).
- The NVMe stage-3 step on CUDA (host gradients through ``to_host``, pinned pools).
What is tested on CPU by faking the CUDA facts instead: ``tests/torch_impl/test_cuda_faked.py``
and ``test_devices.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moezero.config import Config
from moezero.data import Batches, make_corpus
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.model.experts import SwiGLU
from moezero.model.moe import MoE
from moezero.model.router import Router, RouterOptions
from moezero.train import build_model
from tests.support.world import run_world
from tests.torch_impl.test_distributed import MICRO
from tests.torch_impl.test_stage3 import offload_cfg

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs (NCCL), {GPUS} here")
one_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
NCCL_VS_GLOO = {"rtol": 2e-4, "atol": 2e-6}  # fp32: CUDA vs CPU kernels and reduction orders
STEPS = 3


def _train(cfg_data: dict, starve: bool, cuda: bool) -> dict:
    """STEPS steps on this rank (on its CUDA device with ``cuda``); with ``starve`` the expert
    bias keeps experts 2, 3 (EP rank 1's) from any token, so rank 1 receives zero rows."""
    cfg = Config.model_validate(cfg_data)
    topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device=device)
    if starve:
        for router in (m for m in engine.model.modules() if isinstance(m, Router)):
            router.expert_bias[2:] = -10.0  # scores are in (0, 1): never chosen
    batches = Batches(make_corpus(None, vocab=32, sources=2, seed=7), seed=3, dp_rank=0,
                      dp_size=1, global_batch=MICRO * 2, seq_len=cfg.train.seq_len)
    losses, sent_to_2_3 = [], []
    for _ in range(STEPS):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        losses.append(engine.train_step([slices[topo.rank]])["loss"])
        sent_to_2_3.append([int(m.last_stats["tokens_per_expert"][2:].sum()) for m in
                            engine.model.modules() if isinstance(m, MoE)])
    params = {k: p.detach().float().cpu().numpy() for k, p in engine.full_parameters().items()}
    engine.close()
    return {"losses": losses, "params": params, "sent_to_2_3": sent_to_2_3}


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("stage,starve", [(2, False), (2, True), (3, False), (3, True)])
def test_two_nccl_ranks_equal_two_gloo_ranks(tmp_path, stage, starve):
    cfg = offload_cfg(stage, expert_bias=starve)
    gpu = run_world(_train, 2, tmp_path / "nccl", cfg, starve, True, backend="nccl",
                    timeout_s=300)
    cpu = run_world(_train, 2, tmp_path / "gloo", cfg, starve, False, timeout_s=300)
    for got, want in zip(gpu, cpu, strict=True):
        np.testing.assert_allclose(got["losses"], want["losses"], **NCCL_VS_GLOO)
        for fqn, value in want["params"].items():
            np.testing.assert_allclose(got["params"][fqn], value, err_msg=fqn, **NCCL_VS_GLOO)
    if starve:  # no rank sends a row to experts 2, 3: EP rank 1 receives zero rows
        assert all(n == 0 for rank in gpu for step in rank["sent_to_2_3"] for n in step)


@pytest.mark.gpu
@one_gpu
def test_expert_bias_router_layer_never_syncs():
    torch.manual_seed(0)
    moe = MoE(64, SwiGLU(64, 128), num_experts=8, router=RouterOptions(expert_bias=True))
    moe = moe.to("cuda", torch.bfloat16).train()
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if not moe.uses_grouped(x):
        pytest.skip("the grouped kernel is not trusted on this device: the loop syncs once")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, aux = moe(x)
        (out.float().square().mean() + aux).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(moe.router.pending_load.sum()) == 256 * 2


@pytest.mark.gpu
@one_gpu
def test_nvme_stage3_step_on_cuda(tmp_path):
    """Stage 3, optimizer and params on NVMe, one CUDA rank: the gradient tier hands
    ``to_host`` host tensors (item 2) and every window is pinned from the pools (item 4)."""
    (tmp_path / "nvme").mkdir()
    cfg = offload_cfg(3, "nvme", "nvme", nvme=str(tmp_path / "nvme"), ep_size=1)
    gpu = _train(cfg, False, True)  # one rank, in this process
    assert np.isfinite(gpu["losses"]).all() and gpu["losses"][-1] < gpu["losses"][0]
