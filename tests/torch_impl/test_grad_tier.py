"""Reduced gradients in swap files (torch_impl/zero/gradtier.py; issue 16): a stage-3 engine
with the optimizer on NVMe keeps no gradient partition in memory between steps, and trains bit
for bit like the same stage with its gradients in memory (optimizer state on the host), at W=1
and 2, ep 1 and 2, fp32 / bf16 / fp16 (overflow skips), clipping on, micro-batches accumulated.
"""

from __future__ import annotations

import gc
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from moezero.zero.gradtier import GradTier
from tests.support.world import run_world
from tests.torch_impl.test_distributed import MICRO
from tests.torch_impl.test_stage3 import offload_cfg
from tests.torch_impl.test_zero import engine_and_batches

STEPS = 3


def tier_cfg(optim: str, *, dtype: str, ep: int, nvme: str, experts: int = 4) -> dict:
    cfg = offload_cfg(3, "nvme", optim, dtype=dtype, nvme=nvme, num_experts=experts)
    cfg["moe"]["ep_size"] = ep
    if dtype == "fp16":  # overflows at first: skipped steps, the scale halved
        cfg["precision"].update(initial_scale_power=24, loss_scale_window=2, hysteresis=1)
    return cfg


def run(cfg_data: dict, world_of_batch: int) -> dict:
    """Steps on this rank's share of the global batch (accumulated over micro-batches)."""
    engine, topo, batches = engine_and_batches(cfg_data, world_of_batch)
    persistent = engine.meter.persistent
    held = sum(s.grad.numel() * s.grad.element_size()
               for s in engine.optimizer.slots if s.grad is not None)
    grad_bytes = sum(s.shard * engine.dtype.itemsize for s in engine.optimizer.slots)
    metrics = []
    for _ in range(STEPS):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        m = engine.train_step(list(slices[topo.rank::topo.world_size]))
        metrics.append((m["loss"], m["grad_norm"], m["skipped"]))
    files = engine.optimizer.param_swap.folder.listing()  # one folder for both tiers
    params = {k: p.detach().float().clone().numpy() for k, p in engine.full_parameters().items()}
    engine.close()
    return {"metrics": metrics, "params": params, "persistent": persistent, "held": held,
            "grad_bytes": grad_bytes, "grad_files": [n for n, _ in files if ".grad." in n]}


CASES = {1: [("fp32", 1), ("fp16", 1)],
         2: [("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2), ("fp16", 2)]}


def cases_for(world: int, nvme: str) -> dict:
    out = {f"{dtype}_ep{ep}_{optim}": (tier_cfg(optim, dtype=dtype, ep=ep, nvme=nvme), 4)
           for dtype, ep in CASES[world] for optim in ("nvme", "cpu")}
    out["more_experts"] = (tier_cfg("nvme", dtype="fp32", ep=1, nvme=nvme, experts=16), 4)
    return out


def run_cases(cases: dict) -> dict:
    return {name: run(*args) for name, args in cases.items()}


def _world(size: int, tmp_path_factory) -> list:
    nvme = str(tmp_path_factory.mktemp("swap"))
    return run_world(run_cases, size, tmp_path_factory.mktemp(f"w{size}"), cases_for(size, nvme),
                     timeout_s=280)


@pytest.fixture(scope="module")
def w1(tmp_path_factory):
    return _world(1, tmp_path_factory)


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    return _world(2, tmp_path_factory)


@pytest.fixture
def worlds(request):
    return lambda size: request.getfixturevalue(f"w{size}")


@pytest.mark.parametrize("world,dtype,ep", [(w, d, ep) for w, cases in CASES.items()
                                            for d, ep in cases])
def test_grads_in_swap_train_bit_for_bit_like_grads_in_memory(worlds, world, dtype, ep):
    ranks = worlds(world)
    for rank in ranks:
        got, want = rank[f"{dtype}_ep{ep}_nvme"], rank[f"{dtype}_ep{ep}_cpu"]
        assert got["metrics"] == want["metrics"]
        for fqn, value in want["params"].items():
            assert np.array_equal(got["params"][fqn], value), fqn
    if dtype == "fp16":
        assert any(skipped for _, _, skipped in ranks[0][f"fp16_ep{ep}_nvme"]["metrics"])


@pytest.mark.parametrize("world", [1, 2])
def test_no_gradient_partition_stays_in_memory(worlds, world):
    """Optimizer and params on NVMe: nothing persistent in memory, whatever the gradients'
    size (4 or 16 experts); the in-memory-gradient twin holds them all."""
    for rank in worlds(world):
        small, large = rank["fp32_ep1_nvme"], rank["more_experts"]
        assert large["grad_bytes"] > 2 * small["grad_bytes"] > 0
        for case in (small, large):
            assert case["held"] == 0
            assert case["persistent"] == 0
            assert len(case["grad_files"]) > 0
        assert rank["fp32_ep1_cpu"]["held"] == small["grad_bytes"]
        assert rank["fp32_ep1_cpu"]["grad_files"] == []


@dataclass(eq=False)
class _Slot:
    shard: int
    group: object = None


class _SlowSwap:
    """Writes that take a while on one 'disk' thread; counts the buffers still alive."""

    def __init__(self) -> None:
        self.disk, self.alive = ThreadPoolExecutor(1), weakref.WeakSet()

    def buffers(self, slot) -> dict:
        buf = torch.empty(slot.shard)
        self.alive.add(buf)
        return {"grad": buf}

    def write(self, slot, bufs) -> list:
        return [self.disk.submit(time.sleep, 0.02)]

    def wait(self, futures) -> None:
        for f in futures:
            f.result()


def test_landing_holds_a_bounded_number_of_partitions():
    """Partitions that land faster than the disk writes them wait for it: no more than
    ``ahead`` elements (plus the newest partition) are held, not the step's every one."""
    swap, slots = _SlowSwap(), [_Slot(100) for _ in range(12)]
    tier = GradTier(swap, slots, ahead=250, meter=None)
    most = 0
    for slot in slots:
        tier.land(slot, 0, 100, torch.ones(100))
        gc.collect()
        most = max(most, len(swap.alive))
    tier.finish()
    assert 0 < most <= 4
    assert float(tier.sums(slots[-1])[0]) == 100.0
