"""Fewer swap bytes at stage 3 with params and optimizer on NVMe (issue 28 item 3):
``offload_param.keep_for_backward`` (the forward's last units stay gathered for backward,
torch_impl/zero/gather.py), ``offload_optimizer.keep_grads`` (reduced gradient partitions
stay in memory, torch_impl/zero/gradtier.py) and ``offload_optimizer.read_in_backward`` (the
step's first state windows read during backward, torch_impl/offload/state.py) change when and
how many bytes move, never the numbers: losses, grad norms and params bit for bit those of the
default, at W=2, ep 2, fp32 and fp16 (steps skipped on overflow); so does
``offload_optimizer.step_in_forward`` (the step behind the next forward). About 45 s at W=2
(nine engines of three steps); a few seconds for ``read_early`` alone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moezero.offload.aio import AsyncIO
from moezero.offload.state import SwapState
from moezero.offload.swapdir import SwapDir
from moezero.plan.layout import STATES
from moezero.zero.behind import StepBehind
from tests.support.world import run_world
from tests.torch_impl.test_distributed import MICRO
from tests.torch_impl.test_grad_tier import tier_cfg
from tests.torch_impl.test_zero import engine_and_batches

STEPS = 3
BIG = 1 << 40  # every unit / every partition fits


def run(cfg_data: dict) -> dict:
    engine, topo, batches = engine_and_batches(cfg_data, 4)
    rows = []
    for _ in range(STEPS):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        rows.append(engine.train_step(list(slices[topo.rank::topo.world_size])))
    opt = engine.optimizer
    out = {"metrics": [(r["loss"], r["grad_norm"]) for r in rows],
           "phases": [r["phases"] for r in rows], "param_read": [r["swap_param_read_bytes"] for r in rows],
           "shard_bytes": sum(s.shard for s in opt.slots) * engine.dtype.itemsize,
           "params": {k: p.detach().float().clone().numpy() for k, p in engine.full_parameters().items()}}
    engine.close()
    return out


def _cfg(nvme: str, dtype: str, *, keep_units: int = 0, keep_grads: int = 0,
         early: int = 0, behind: bool = False) -> dict:
    cfg = tier_cfg("nvme", dtype=dtype, ep=2, nvme=nvme)
    cfg["zero_optimization"]["offload_param"]["keep_for_backward"] = keep_units
    cfg["zero_optimization"]["offload_optimizer"].update(keep_grads=keep_grads,
                                                         read_in_backward=early,
                                                         step_in_forward=behind)
    return cfg


def cases(nvme: str) -> dict:
    out = {}
    for dtype in ("fp32", "fp16"):  # fp16: half-size gradients, steps skipped on overflow
        out[f"{dtype}_default"] = _cfg(nvme, dtype)
    out["fp32_keep_all"] = _cfg(nvme, "fp32", keep_units=BIG, keep_grads=BIG)
    out["fp16_keep_all"] = _cfg(nvme, "fp16", keep_units=BIG, keep_grads=BIG, early=BIG)
    # budgets below the whole: the latest unit(s) / the first partitions to land only
    out["fp32_keep_some"] = _cfg(nvme, "fp32", keep_units=700_000, keep_grads=20_000)
    out["fp32_early"] = _cfg(nvme, "fp32", early=BIG)
    # the step behind the next forward: alone, and with every budget
    out["fp32_behind"] = _cfg(nvme, "fp32", behind=True)
    out["fp16_behind"] = _cfg(nvme, "fp16", behind=True)
    out["fp32_behind_keep_all"] = _cfg(nvme, "fp32", keep_units=BIG, keep_grads=BIG, early=BIG,
                                       behind=True)
    return out


def run_cases(named: dict) -> dict:
    return {name: run(cfg) for name, cfg in named.items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp("swap"))
    return run_world(run_cases, 2, tmp_path_factory.mktemp("w2"), cases(nvme), timeout_s=280)


def _grad_bytes(phases: dict) -> tuple[int, int]:
    return (sum(p["grad_write"] for p in phases.values()),
            sum(p["grad_read"] for p in phases.values()))


def _same(got: dict, want: dict, name: str) -> None:
    assert got["metrics"] == want["metrics"], name
    for fqn, value in want["params"].items():
        assert np.array_equal(got["params"][fqn], value), (name, fqn)


@pytest.mark.parametrize("name", ["fp32_keep_all", "fp32_keep_some", "fp16_keep_all"])
def test_keeping_units_and_grads_changes_bytes_not_results(ranks, name):
    for rank in ranks:
        want = rank[name.split("_")[0] + "_default"]
        got = rank[name]
        _same(got, want, name)
        # fewer param shard reads every step, fewer gradient bytes through the swap files
        assert all(g < w for g, w in zip(got["param_read"], want["param_read"], strict=True))
        for g, w in zip(got["phases"], want["phases"], strict=True):
            assert _grad_bytes(w)[0] == want["shard_bytes"]  # fp16: no read in a skipped step
            assert max(_grad_bytes(g)) < want["shard_bytes"], name


def test_a_budget_for_everything_halves_param_reads_and_moves_no_gradient(ranks):
    """All units kept: backward fetches nothing, so after the first step (whose forward reads
    on demand) a step reads half the param shard bytes of the default (forward only); all
    partitions kept: no gradient byte goes to disk."""
    for rank in ranks:
        for dtype in ("fp32", "fp16"):
            got, want = rank[f"{dtype}_keep_all"], rank[f"{dtype}_default"]
            assert [2 * r for r in got["param_read"][1:]] == want["param_read"][1:], dtype
            assert all(_grad_bytes(p) == (0, 0) for p in got["phases"]), dtype


def test_state_read_in_backward_moves_the_reads_not_the_results(ranks):
    """Every master/moment read issued in backward, none at the step (here the whole state is
    one window, the budget's unit); fp16 with steps skipped on overflow (the reads started
    stay for the next step)."""
    for rank in ranks:
        _same(rank["fp32_early"], rank["fp32_default"], "fp32_early")
        assert any(n == float("inf") for _, n in rank["fp16_default"]["metrics"])  # a skip
        state = 3 * rank["fp32_early"]["shard_bytes"]  # master and moments, fp32
        for p in rank["fp32_early"]["phases"]:
            assert (p["backward"]["optim_read"], p["step"]["optim_read"]) == (state, 0)


@pytest.mark.parametrize("name", ["fp32_behind", "fp16_behind", "fp32_behind_keep_all"])
def test_a_step_behind_the_forward_changes_when_not_what(ranks, name):
    """``step_in_forward``: each step's swapped updates run behind the next forward, whose
    gathers wait per group for its written master: the same losses, grad norms (fp16: the
    same skipped steps) and params bit for bit as the step run before the forward. In fp32
    the forward gathers the masters the step hands over (``SwapState.offer``) rather than
    reading them back: fewer param bytes read after the first step."""
    for rank in ranks:
        got, want = rank[name], rank[name.split("_")[0] + "_default"]
        _same(got, want, name)
        assert got["param_read"][0] > 0
        if name == "fp32_behind":
            assert all(g < w for g, w in zip(got["param_read"][1:], want["param_read"][1:],
                                             strict=True))


@dataclass(eq=False)
class _Slot:
    shard: int
    group: object


def test_read_early_takes_whole_windows_within_the_budget_and_a_write_drops_them(tmp_path):
    """Three one-slot windows of 1024 fp32 elements (12 KiB of state each): a 30 KiB budget
    reads the first two early; a write to the second drops its read; stepping returns the
    files' bytes either way (one process, real swap files; well under a second)."""
    slots = [_Slot(1024, SimpleNamespace(name=f"g{i}")) for i in range(3)]
    swap = SwapState(SwapDir(tmp_path, 0).acquire(), AsyncIO(2), slots, STATES, torch.float32,
                     key="test")
    swap.allocate()
    for i, slot in enumerate(slots):
        swap.put(slot, {s: float(10 * i + k) for k, s in enumerate(STATES)})
    windows = [[s] for s in slots]
    swap.read_early(windows, 30 << 10)
    assert [w[0].group.name for w in swap.early] == ["g0", "g1"]
    swap.put(slots[1], {s: -1.0 for s in STATES})  # written after its early read started
    assert [w[0].group.name for w in swap.early] == ["g0"]
    seen = [float(bufs[0]["exp_avg"][0]) for bufs in swap.stepping(windows)]
    assert seen == [1.0, -1.0, 21.0] and swap.early == {}
    swap.close(remove=True)


def test_a_gated_slot_loads_once_written_and_is_never_read_ahead(tmp_path):
    """``SwapState.gate``: a load of a slot being rewritten waits for ``open`` (here from
    another thread, after the write) and returns the written bytes; a hint skips it."""
    slot = _Slot(1024, SimpleNamespace(name="g0"))
    swap = SwapState(SwapDir(tmp_path, 0).acquire(), AsyncIO(2), [slot], ("param",),
                     torch.float32, key="test")
    swap.allocate()
    swap.put(slot, {"param": 1.0})
    swap.gate([slot])
    swap.hint([slot])
    assert swap.ahead.pending == {} and not swap.written(slot)

    def rewrite():
        swap.put(slot, {"param": 2.0})
        swap.open([slot])

    writer = threading.Timer(0.2, rewrite)
    writer.start()
    assert float(swap.load(slot)["param"][0]) == 2.0
    writer.join()
    assert swap.written(slot) and swap.traffic["wait_s"] > 0.1
    # handed over (``offer``) and written: a hint reads nothing, the load takes the buffer
    swap.offer(slot, {"param": torch.full((1024,), 3.0)})
    reads = swap.traffic["read"]
    swap.hint([slot])
    assert swap.ahead.pending == {} and swap.traffic["read"] == reads
    assert float(swap.load(slot)["param"][0]) == 3.0 and swap.offered == {}
    swap.close(remove=True)


def test_a_step_behind_that_fails_opens_every_gate_and_raises_at_finish():
    """The step thread fails (e.g. a full disk on a write): no gathered group stays gated
    (the forward must not hang), and the error is raised where the main thread next needs the
    step done (``finish``: the next backward, a save, close), once."""
    slots = [_Slot(8, SimpleNamespace(name=f"g{i}")) for i in range(2)]
    swap = SimpleNamespace(unwritten={}, alias="master")
    swap.gate = lambda ss: swap.unwritten.update(dict.fromkeys(ss))
    swap.open = lambda ss: [swap.unwritten.pop(s, None) for s in ss]

    def full_disk(**hooks):
        assert set(swap.unwritten) == set(slots) and set(hooks) == {"written", "issued"}
        raise OSError(28, "No space left on device")

    behind = StepBehind(swap, handover_bytes=0)
    behind.start(slots, full_disk)
    with pytest.raises(OSError, match="No space left"):
        behind.finish()
    assert swap.unwritten == {}
    behind.finish()  # raised once: nothing left behind
