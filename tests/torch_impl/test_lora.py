"""LoRA (``peft.method: lora``, torch_impl/model/lora.py): adapters on attention, the shared
expert and the routed experts (grouped GEMMs), the base frozen. Training at W=2 ep=2, ZeRO
stages 0-3 with offload none/cpu/nvme gives the W=1 stage-0 losses and adapters (fp32
tolerances of the ZeRO parity), the base stays bit-identical, and the optimizer holds the
adapters only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moezero.distributed.topology import build_topology
from moezero.model.moe import MoE
from moezero.train import build_model
from tests.support.compare import assert_close_by_fqn, rel_err
from tests.support.world import run_world
from tests.torch_impl.test_distributed import MICRO, merged, small_config
from tests.torch_impl.test_freeze import cfg_of
from tests.torch_impl.test_zero import engine_and_batches
from tests.torch_impl.tolerances import GROUPED_RTOL, RTOL

STEPS = 3
TARGETS = ["attn", "shared", "experts"]


def lora_cfg(stage: int, offload: str, nvme: str | None, ep: int = 2) -> dict:
    cfg = cfg_of(stage, offload, [], nvme, ep=ep)
    cfg["moe"]["shared_ffn_dim"] = 16
    cfg["peft"] = {"method": "lora", "r": 4, "alpha": 8.0, "targets": TARGETS}
    cfg["optimizer"]["lr"] = 1e-2  # the adapters move visibly in a few steps
    return cfg


def train(cfg_data: dict, world_of_batch: int = 2) -> dict:
    engine, topo, batches = engine_and_batches(cfg_data, world_of_batch)
    initial = _full(engine)
    losses = []
    for _ in range(STEPS):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        losses.append(engine.train_step(list(slices[topo.rank::topo.world_size]))["loss"])
    stateful = {piece.fqn for piece, _ in engine.optimizer.state_pieces()}
    out = {"losses": losses, "initial": initial, "params": _full(engine), "stateful": stateful}
    engine.close()
    return out


def _full(engine) -> dict:
    return {k: p.detach().float().clone().numpy() for k, p in engine.full_parameters().items()}


def run_cases(cases: dict) -> dict:
    return {name: train(*args) for name, args in cases.items()}


NAMES = ["s0_none", "s1_none", "s2_cpu", "s2_nvme", "s3_none", "s3_cpu", "s3_nvme"]


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp("swap"))
    cases = {name: (lora_cfg(int(name[1]), name[3:], nvme),) for name in NAMES}
    return run_world(run_cases, 2, tmp_path_factory.mktemp("w2"), cases, timeout_s=500)


@pytest.fixture(scope="module")
def w1(tmp_path_factory):
    (res,) = run_world(run_cases, 1, tmp_path_factory.mktemp("w1"),
                       {"oracle": (lora_cfg(0, "none", None, ep=1), 2)})
    return res["oracle"]


@pytest.mark.parametrize("name", NAMES)
def test_lora_at_w2_ep2_equals_w1_stage0(w2, w1, name):
    runs = [r[name] for r in w2]
    for got, want in zip(runs[0]["losses"], w1["losses"], strict=True):
        assert rel_err(got, want) <= RTOL["fp32"]
    assert w1["losses"][-1] < w1["losses"][0]
    assert_close_by_fqn(merged(runs, "params"), w1["params"], RTOL["fp32"])
    adapters = {f for f in merged(runs, "params") if ".lora_" in f}
    assert any(".experts." in f for f in adapters) and any(".shared." in f for f in adapters)
    # the ranks' optimizer state covers the adapters, and nothing else
    assert set().union(*(run["stateful"] for run in runs)) == adapters
    for run in runs:
        for fqn, value in run["params"].items():
            moved = not np.array_equal(value, run["initial"][fqn])
            assert moved == (fqn in adapters), fqn


def test_fresh_adapters_leave_the_model_unchanged_and_grouped_equals_the_loop():
    cfg = small_config(ep_size=1)
    cfg.moe.shared_ffn_dim = 16
    topo = build_topology([1], num_experts=4)
    x = torch.randint(0, 32, (2, 17))
    base_loss = build_model(cfg, topo).loss(x)[0]
    cfg.peft.method, cfg.peft.targets, cfg.peft.r = "lora", TARGETS, 4
    model = build_model(cfg, topo)
    assert torch.equal(model.loss(x)[0], base_loss)
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            if fqn.endswith("lora_B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(fqn)))
    grads = {}
    for grouped in (True, False):
        for module in model.modules():
            if isinstance(module, MoE):
                module.grouped = grouped
        model.zero_grad()
        loss = model.loss(x)[0]
        loss.backward()
        grads[grouped] = {k: p.grad.clone() for k, p in model.named_parameters()
                          if p.grad is not None}
        grads[grouped]["loss"] = loss.detach()
    assert not torch.equal(grads[True]["loss"], base_loss)
    assert any(".experts." in k and "lora_A" in k for k in grads[True])
    assert_close_by_fqn(grads[True], grads[False], GROUPED_RTOL["fp32"])
