"""Read-ahead of NVMe param shards at stage 3 (torch_impl/offload/readahead.py, the hints of
torch_impl/zero/gather.py): bit-identical to reading on demand, reads issued while earlier
units compute, at most ``read_ahead`` units' shards in host buffers, per-step swap traffic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moezero.config import load_config
from moezero.zero.options import ZeroOptions
from tests.support.world import run_world
from tests.torch_impl.test_distributed import MICRO
from tests.torch_impl.test_stage3 import offload_cfg
from tests.torch_impl.test_zero import engine_and_batches

STEPS = 4
WORLD_OF_BATCH = 2


def readahead_cfg(nvme: str, *, ep: int, optim: str, read_ahead: int) -> dict:
    cfg = offload_cfg(3, "nvme", optim, nvme=nvme)
    cfg["moe"]["ep_size"] = ep
    cfg["zero_optimization"]["offload_param"]["read_ahead"] = read_ahead
    # the step before the forward: with the step behind it (the nvme/nvme default) the
    # forward takes the stepped masters or waits for them (test_nvme_bytes.py)
    cfg["zero_optimization"]["offload_optimizer"]["step_in_forward"] = False
    return cfg


class Trace:
    """Events of one engine's param swap files: reads issued (by a load, or ahead of it),
    loads (served by a read-ahead or not), and compute (a leaf module's forward ended, a
    parameter's gradient accumulated), in the order they happened."""

    def __init__(self, engine):
        self.events: list[tuple] = []
        self.read_bytes = 0
        swap, self.loading = engine.optimizer.param_swap, False
        read, load = swap.read, swap.load

        def traced_read(slot, bufs):
            self.read_bytes += sum(b.nbytes for b in bufs.values())
            self.events.append(("read" if self.loading else "ahead", slot.group.name))
            return read(slot, bufs)

        def traced_load(slot):
            ahead, self.loading = slot in swap.ahead.pending, True
            try:
                return load(slot)
            finally:
                self.loading = False
                self.events.append(("load", slot.group.name, ahead))

        swap.read, swap.load = traced_read, traced_load  # this instance only
        for module in engine.model.modules():
            if not list(module.children()):
                module.register_forward_hook(lambda *_: self.events.append(("compute",)))
        for p in engine.params.values():
            p.register_post_accumulate_grad_hook(lambda _p: self.events.append(("compute",)))
        # after the gatherer's own hook, which hints backward's first units
        engine.model.register_forward_hook(lambda *_: self.events.append(("forward_end",)))

    def summary(self) -> dict:
        """Loads served ahead / on demand; of those served ahead, the ones read between steps
        (hinted after a step for the next forward's first units), the ones read across the
        loss (hinted when the forward ends for backward's first units) and the ones whose
        read was issued with no compute before the load; reads issued outside a load."""
        issued: dict[str, int] = {}  # slot name -> index of its latest read-ahead
        out = {"ahead_loads": 0, "sync_loads": 0, "between_steps": 0, "across_loss": 0,
               "not_overlapped": 0, "reads_ahead": 0}
        for i, event in enumerate(self.events):
            if event[0] == "ahead":
                issued[event[1]] = i
                out["reads_ahead"] += 1
            elif event[0] == "load" and event[2]:
                out["ahead_loads"] += 1
                between = {e[0] for e in self.events[issued[event[1]]:i]}
                out["between_steps"] += "step" in between
                out["across_loss"] += "compute" not in between and "forward_end" in between
                out["not_overlapped"] += not between & {"compute", "step", "forward_end"}
            elif event[0] == "load":
                out["sync_loads"] += 1
        return out


def unit_bound(engine, read_ahead: int) -> int:
    """``read_ahead`` x the largest unit's shard bytes (of its groups' param shards)."""
    opt = engine.optimizer
    size = engine.dtype.itemsize
    return read_ahead * max(sum(opt.slots[i].shard * size for i in unit.slots)
                            for unit in opt.gatherer.units)


def train(cfg_data: dict) -> dict:
    engine, topo, batches = engine_and_batches(cfg_data, WORLD_OF_BATCH)
    trace, rows, traced = Trace(engine), [], []
    for _ in range(STEPS):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        before = trace.read_bytes
        rows.append(engine.train_step(list(slices[topo.rank::topo.world_size])))
        traced.append(trace.read_bytes - before)
        trace.events.append(("step",))
    opt = engine.optimizer
    read_ahead = cfg_data["zero_optimization"]["offload_param"]["read_ahead"]
    out = {"losses": [r["loss"] for r in rows], "metrics": rows, "traced_read_bytes": traced,
           "shard_elems": sum(s.shard for s in opt.slots), "trace": trace.summary(),
           "stats": dict(opt.param_swap.ahead.stats), "bound": unit_bound(engine, read_ahead),
           "params": {k: p.detach().clone().numpy() for k, p in engine.full_parameters().items()}}
    engine.close()
    out["left_ahead"] = len(opt.param_swap.ahead.pending)
    return out


def run_cases(cases: dict) -> dict:
    return {name: train(cfg) for name, cfg in cases.items()}


def _cases(nvme: str, world: int) -> dict:
    cases = {}
    for ep in (1, 2) if world == 2 else (1,):
        for optim in ("none", "nvme"):
            for depth in (0, 2):
                cases[f"ep{ep}_{optim}_ra{depth}"] = readahead_cfg(nvme, ep=ep, optim=optim,
                                                                  read_ahead=depth)
    if world == 2:
        cases["ep2_none_ra1"] = readahead_cfg(nvme, ep=2, optim="none", read_ahead=1)
    return cases


@pytest.fixture(scope="module", params=[1, 2], ids=["w1", "w2"])
def runs(request, tmp_path_factory):
    world = request.param
    nvme = str(tmp_path_factory.mktemp(f"swap_w{world}"))
    return run_world(run_cases, world, tmp_path_factory.mktemp(f"w{world}"),
                     _cases(nvme, world), timeout_s=300)


def _names(runs, depth: int) -> list[str]:
    return [name for name in runs[0] if name.endswith(f"_ra{depth}")]


def test_read_ahead_is_bit_identical_to_reading_on_demand(runs):
    for rank in runs:
        for name in _names(runs, 2) + _names(runs, 1):
            off, on = rank[name.rpartition("_ra")[0] + "_ra0"], rank[name]
            assert on["losses"] == off["losses"], name
            assert on["params"].keys() == off["params"].keys()
            for fqn, value in off["params"].items():
                assert np.array_equal(on["params"][fqn], value), (name, fqn)


def test_reads_are_issued_while_earlier_units_compute(runs):
    """At the default depth (2); at depth 1 a unit fetched right after the one before it
    (a MoE layer's units after its block's, with no parameter between) is hinted just before
    its fetch, with nothing to overlap."""
    for rank in runs:
        for name in _names(runs, 2):
            trace, stats = rank[name]["trace"], rank[name]["stats"]
            assert trace["ahead_loads"] == stats["ahead"] > 0, name
            # steady state: the first forward and each backward's first unit read on demand
            assert trace["ahead_loads"] >= 2 * trace["sync_loads"], (name, trace)
            # the others overlap the data between steps, or the loss before backward
            assert trace["ahead_loads"] > trace["between_steps"] + trace["across_loss"], name
            assert trace["not_overlapped"] == 0, (name, trace)


def test_read_ahead_buffers_stay_within_the_bound(runs):
    for rank in runs:
        for name in _names(runs, 2) + _names(runs, 1):
            run = rank[name]
            assert 0 < run["stats"]["peak_bytes"] <= run["bound"], (name, run["stats"])
            assert run["left_ahead"] == 0, name  # closed: nothing read ahead is left


def test_read_ahead_0_reads_each_shard_when_its_gather_starts(runs):
    for rank in runs:
        for name in _names(runs, 0):
            trace, stats = rank[name]["trace"], rank[name]["stats"]
            assert trace["reads_ahead"] == trace["ahead_loads"] == 0, name
            assert trace["sync_loads"] == stats["sync"] > 0, name
            assert stats["peak_bytes"] == 0, name


def test_metrics_count_swap_bytes_per_step(runs):
    for rank in runs:
        for name, run in rank.items():
            shard_bytes = run["shard_elems"] * 4  # fp32 params; master and moments fp32
            # With the optimizer on NVMe too (one folder, fp32) the params are the master's
            # files: no param write; the step reads and writes master and moments, and the
            # gradient tier writes and reads each reduced partition once.
            nvme_optim = "_nvme_" in name
            param_writes = 0 if nvme_optim else shard_bytes  # else one downcast each
            optim = 4 * shard_bytes if nvme_optim else 0
            for row, traced in zip(run["metrics"], run["traced_read_bytes"], strict=True):
                assert row["swap_param_read_bytes"] == traced > 0, name
                assert row["swap_param_write_bytes"] == param_writes, name
                assert row["swap_read_bytes"] == traced + optim, name
                assert row["swap_write_bytes"] == param_writes + optim, name


def test_metrics_split_swap_bytes_and_waits_by_phase(runs):
    """``phases``: each tier's bytes by the phase that issued them (the step reads and writes
    master and moments, the reduction writes each gradient partition, the step reads it back;
    param reads are issued in every phase: on demand, or ahead), and seconds blocked."""
    for rank in runs:
        for name, run in rank.items():
            shard_bytes = run["shard_elems"] * 4
            for row in run["metrics"]:
                p = row["phases"]
                assert list(p) == ["forward", "backward", "reduce", "step"], name
                assert sum(p[n]["param_read"] for n in p) == row["swap_param_read_bytes"]
                assert p["forward"]["param_read"] > 0 and p["backward"]["param_read"] > 0
                if "_nvme_" not in name:
                    assert all(p[n]["optim_read"] == p[n]["grad_write"] == 0 for n in p), name
                    continue
                assert p["step"]["optim_read"] == p["step"]["optim_write"] == 3 * shard_bytes
                assert p["backward"]["grad_write"] + p["reduce"]["grad_write"] == shard_bytes, name
                assert p["step"]["grad_read"] == shard_bytes, name
                assert p["forward"]["optim_read"] == p["backward"]["optim_write"] == 0, name
                assert all(p[n][f"{t}_wait_s"] >= 0 for n in p for t in ("optim", "grad"))


def test_read_ahead_key_reaches_the_optimizer_options():
    assert ZeroOptions.from_config(load_config(None).zero_optimization).param_read_ahead == 2
    cfg = load_config(None, ["zero_optimization.offload_param.read_ahead=5"])
    assert ZeroOptions.from_config(cfg.zero_optimization).param_read_ahead == 5
