"""Sharded construction (torch_impl/model/materialize.py): a model built on the meta device,
materialised by the engine, starts from the same weights and optimizer state, bit for bit, as
the fully built model (``train.build_model``), for W = 1, 2, 4, ep 1 and 2, stages 0-3 and
offload none/cpu/nvme, with the same buffers (the routers' expert bias, also with LoRA); and
initialising a model larger than a memory budget stays under it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moezero.config import Config
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.model.materialize import KeyedInit, materialize, meta_model
from moezero.train import build_model, sharded_model
from tests.support.world import run_world
from tests.torch_impl.test_estimate import case


def state_of(engine) -> dict:
    """This rank's params (full, by FQN), buffers (by FQN, with their dtype) and fp32 optimizer
    state (by group and state) as bytes."""
    out = {fqn: p.detach().contiguous().view(torch.uint8).numpy().tobytes()
           for fqn, p in engine.full_parameters().items()}
    out.update({f"buffer:{fqn}:{b.dtype}": b.contiguous().view(torch.uint8).numpy().tobytes()
                for fqn, b in engine.model.named_buffers()})
    for shard in engine.optimizer.shards():
        name = shard.partition.group
        for state, t in (shard.tensors or {}).items():
            out[f"{name}:{state}"] = t.contiguous().numpy().tobytes()
        for state, path in (shard.files or {}).items():
            out[f"{name}:{state}"] = Path(path).read_bytes()
    return out


def compare(cases: list[dict]) -> list[str]:
    """Per config on this rank: the names whose bytes differ between the two constructions."""
    out = []
    for cfg_data in cases:
        cfg = Config.model_validate(cfg_data)
        topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
        full = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
        want = state_of(full)
        full.close()
        model, init = sharded_model(cfg, topo)
        sharded = initialize(model, cfg, topology=topo, device="cpu", init=init)
        got = state_of(sharded)
        sharded.close()
        assert want.keys() == got.keys() and len(want) > 0
        out.append(sorted(k for k in want if want[k] != got[k]))
    return out


def test_same_values_at_w1():
    cases = [case(s) for s in (0, 1, 2, 3)] + [case(3, dtype="bf16"), case(2, dtype="bf16")]
    assert compare(cases) == [[]] * len(cases)


def test_same_values_at_w2(tmp_path):
    nvme = str(tmp_path)
    cases = [case(0, ep=2), case(1), case(2, ep=2, optim="cpu", dtype="bf16"), case(3, ep=2),
             case(3, ep=2, param="cpu", optim="cpu"), case(3, param="nvme", optim="nvme", nvme=nvme),
             case(3, ep=2, param="nvme", optim="nvme", nvme=nvme, dtype="bf16"),
             case(3, ep=2, optim="nvme", nvme=nvme, cap=None)]
    assert run_world(compare, 2, tmp_path, cases) == [[[]] * len(cases)] * 2


def test_same_values_at_w4(tmp_path):
    cases = [case(2, ep=2), case(3, ep=2, param="nvme", optim="nvme", nvme=str(tmp_path))]
    assert run_world(compare, 4, tmp_path, cases, timeout_s=120) == [[[]] * len(cases)] * 4


def biased(cfg_data: dict, lora: bool = False) -> dict:
    """``cfg_data`` with the routers' expert bias (buffers: the bias and the load counts) and,
    with ``lora``, adapters on the attention and the experts."""
    out = {**cfg_data, "moe": {**cfg_data["moe"], "expert_bias": True}}
    return {**out, "peft": {"method": "lora", "targets": ["attn", "experts"]}} if lora else out


def test_buffers_get_the_built_models_values():
    """The expert bias and load counts of a meta-built model materialise as the built model's
    (zeros; the bias fp32 also in bf16), at every stage and with LoRA; at W = 2 below."""
    cases = [biased(case(s)) for s in (0, 1, 2, 3)] + [
        biased(case(3, dtype="bf16")), biased(case(2), lora=True), biased(case(3), lora=True)]
    assert compare(cases) == [[]] * len(cases)


def test_buffers_at_w2(tmp_path):
    cases = [biased(case(3, ep=2)), biased(case(0, ep=2, dtype="bf16"), lora=True)]
    assert run_world(compare, 2, tmp_path, cases) == [[[]] * len(cases)] * 2


class _Counts(torch.nn.Module):
    """A module with a buffer and no ``reset_buffers``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(3))


def test_a_meta_buffer_without_reset_buffers_is_one_line():
    model = meta_model(lambda: torch.nn.Sequential(_Counts()))
    with pytest.raises(ValueError, match=r"^materialize: buffer 0\.seen is on the meta device "
                                         r"and _Counts has no reset_buffers\(\)"):
        materialize(model, KeyedInit(0), device=torch.device("cpu"), dtype=torch.float32,
                    values=True)


def test_keyed_init_equals_init_weights_and_keeps_expert_tags():
    cfg = Config.model_validate(case(2, ep=1))
    topo = build_topology([1], num_experts=cfg.moe.num_experts)
    full = build_model(cfg, topo)
    model, init = sharded_model(cfg, topo)
    assert all(p.is_meta for p in model.parameters())
    materialize(model, init, device=torch.device("cpu"), dtype=torch.float32, values=True)
    got, want = dict(model.named_parameters()), dict(full.named_parameters())
    assert got.keys() == want.keys()
    for fqn, p in want.items():
        assert torch.equal(got[fqn], p) and getattr(got[fqn], "moe", None) == getattr(p, "moe", None), fqn
    empty = meta_model(lambda: torch.nn.Linear(4, 3, bias=False))
    materialize(empty, KeyedInit(0), device=torch.device("cpu"), dtype=torch.float32, values=False)
    assert empty.weight.shape == (3, 4) and empty.weight.untyped_storage().nbytes() == 0


# A model of ~100 MB fp32 at stage 3 on one rank with the optimizer state and params in swap
# files: the engine keeps only its gradient partitions in memory (its MemoryMeter's persistent
# bytes), so initialising it must cost no more than those plus a budget smaller than the model.
_PEAK = r"""
import sys
import torch
from moezero.config import Config
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.telemetry import PeakMemory
from moezero.train import build_model, sharded_model
nvme, mode = sys.argv[1], sys.argv[2]
cfg = Config.model_validate({
    "model": {"vocab_size": 256, "dim": 512, "n_layers": 2, "n_heads": 4, "ffn_dim": 1024},
    "moe": {"num_experts": 8, "ep_size": 1, "max_group_size": 1 << 20},
    "precision": {"dtype": "fp32"},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                          "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}})
topo = build_topology([1], num_experts=8)
sharded_model(cfg, topo)  # the meta device's one-time imports (~70 MB); no storage
memory = PeakMemory(torch.device("cpu"))
memory.reset()  # the peak RSS (VmHWM) restarts from the current RSS
assert memory.resettable
before = memory.peak()
if mode == "sharded":
    model, init = sharded_model(cfg, topo)
    engine = initialize(model, cfg, topology=topo, device="cpu", init=init)
else:
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
peak = memory.peak()
model_bytes = sum(4 * s.numel for s in engine.optimizer.slots)
print(peak - before, model_bytes, engine.meter.persistent)
engine.close()
"""

# A fixed mmap threshold makes glibc hand freed blocks of over 128 KiB back at once, so the
# peak RSS measures what is alive rather than what the heap kept after the per-group buffers.
MEASURE_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
BUDGET_FRACTION = 0.5  # of the model's fp32 bytes, beyond the state the engine keeps


def init_growth(tmp_path, mode: str) -> tuple[int, int, int]:
    run = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path), mode], capture_output=True,
                         text=True, timeout=300, env={**os.environ, **MEASURE_ENV})
    assert run.returncode == 0, run.stderr
    growth, model_bytes, persistent = map(int, run.stdout.split())
    return growth - persistent, model_bytes, persistent


def test_initialising_a_model_larger_than_the_budget_stays_under_it(tmp_path):
    growth, model_bytes, persistent = init_growth(tmp_path, "sharded")
    assert model_bytes > 90e6 and persistent <= model_bytes  # the grad partitions alone
    assert growth < BUDGET_FRACTION * model_bytes, (growth, model_bytes)


def test_full_construction_exceeds_that_budget(tmp_path):
    """The same run built the old way (the whole model first) is over the budget: the
    test above can fail."""
    growth, model_bytes, _ = init_growth(tmp_path, "full")
    assert growth > BUDGET_FRACTION * model_bytes, (growth, model_bytes)

