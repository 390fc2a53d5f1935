"""moezero.telemetry and moezero.validation: expert load against a count made here, the
dropped fraction under a capacity, per-step (not cumulative) peak memory, FLOPs per token,
TensorBoard files, and validation at ZeRO-3 (gathered forwards without gradients)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moezero.config import load_config
from moezero.model.args import model_args
from moezero.model.decoder import ModelArgs
from moezero.model.moe import MoE, SwiGLU, route
from moezero.telemetry import (
    ExpertLoad,
    PeakMemory,
    TensorBoard,
    flops_per_token,
    layer_load,
    peak_flops,
)
from moezero.train import model_numel, setup
from moezero.validation import evaluate

TINY = ["model.dim=16", "model.n_layers=2", "model.n_heads=2", "model.ffn_dim=16",
        "moe.num_experts=4", "moe.ep_size=1", "train.seq_len=8", "train.micro_batch_size=2"]


def test_layer_load_math():
    row = layer_load("layers.0.moe", [6, 2, 0, 0], dropped=2)
    assert row["dropped_frac"] == pytest.approx(0.2) and row["imbalance"] == pytest.approx(3.0)
    assert layer_load("x", [0, 0], 0)["imbalance"] is None


@pytest.mark.parametrize("capacity", [None, 0.5])
def test_expert_load_counts_the_routing_of_every_micro_batch(capacity):
    torch.manual_seed(0)
    moe = MoE(8, lambda e: SwiGLU(8, 8), num_experts=4, top_k=2, capacity_factor=capacity)
    load = ExpertLoad(torch.nn.Sequential(moe), torch.device("cpu"))
    xs = [torch.randn(10, 8) for _ in range(3)]
    with torch.no_grad():
        for x in xs:
            moe(x)
        with load.paused():
            moe(torch.randn(50, 8))  # a validation forward: not counted
    (row,) = load.collect(distributed=False)
    chosen = torch.cat([route(x @ moe.router.weight.t(), 2)[2].reshape(-1) for x in xs])
    routed = np.bincount(chosen.numpy(), minlength=4)
    assert sum(row["tokens_per_expert"]) + round(row["dropped_frac"] * 60) == 60
    if capacity is None:
        assert row["tokens_per_expert"] == routed.tolist() and row["dropped_frac"] == 0
    else:  # capacity ceil(0.5 * 10 * 2 / 4) = 3 per expert and micro-batch
        assert max(row["tokens_per_expert"]) <= 3 * 3 and row["dropped_frac"] > 0
    assert row["imbalance"] == pytest.approx(max(row["tokens_per_expert"]) /
                                             np.mean(row["tokens_per_expert"]))
    assert load.collect(distributed=False)[0]["tokens_per_expert"] == [0, 0, 0, 0]


def test_peak_memory_is_per_window_not_since_start():
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    big = np.ones(64 * 2**20 // 8)  # 64 MiB touched
    first = memory.peak()
    del big
    memory.reset()
    second = memory.peak()
    if not memory.resettable:
        pytest.skip("this kernel cannot reset the peak RSS (/proc/self/clear_refs)")
    assert first - second > 48 * 2**20, (first, second)


def test_flops_per_token_counts_the_active_parameters():
    cfg = load_config(None, TINY + ["moe.top_k=1"])
    args = model_args(cfg)
    d, f, e, v, layers = 16, 16, 4, 256, 2
    active = layers * (4 * d * d + 3 * d * f + d * e) + v * d
    assert flops_per_token(args, 8) == 6 * active + 12 * layers * d * 8
    all_experts = ModelArgs(**{**args.__dict__, "top_k": e})
    embed, norms = v * d, (2 * layers + 1) * d  # no matrix product: not counted
    assert (flops_per_token(all_experts, 8) - 12 * layers * d * 8) / 6 == model_numel(
        load_config(None, TINY + ["moe.top_k=4"])) - embed - norms
    assert peak_flops(torch.device("cpu"), torch.float32) is None


def test_tensorboard_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    tb = TensorBoard(tmp_path / "tb")
    tb.write({"step": 1, "loss": 2.0, "val_loss": 2.5, "skipped": False,
              "moe": [{"layer": "layers.0.moe", "dropped_frac": 0.0, "imbalance": 1.5}]})
    tb.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "val/val_loss", "moe/layers.0.moe/imbalance"} <= tags
    assert "train/skipped" not in tags
    assert TensorBoard(None).writer is None


@pytest.mark.parametrize("stage", [0, 3])
def test_validation_without_gradients_then_training_goes_on(stage):
    cfg = load_config(None, TINY + [f"zero_optimization.stage={stage}", "train.eval_batches=2"])
    engine, batches = setup(cfg, torch.device("cpu"))
    load = ExpertLoad(engine.model, engine.device)
    first = evaluate(engine, batches, 2, load)
    assert load.collect(distributed=False)[0]["tokens_per_expert"] == [0, 0, 0, 0]
    engine.train_step([torch.from_numpy(batches.next())])
    assert sum(load.collect(distributed=False)[0]["tokens_per_expert"]) == 2 * 8 * 2
    again = evaluate(engine, batches, 2, load)
    assert again["val_loss"] != first["val_loss"]  # same batches, updated weights
    assert again["val_ppl"] == pytest.approx(np.exp(again["val_loss"]))
    with torch.no_grad():
        manual = np.mean([engine.forward(torch.from_numpy(batches.val_batch(j)))[1]["ce"].item()
                          for j in range(2)])
    assert again["val_loss"] == pytest.approx(manual, rel=1e-6)
    engine.close()


_CHILD_PEAK = """
import torch
from moezero.memory.peak import peak_memory_bytes
from moezero.telemetry import PeakMemory
print(peak_memory_bytes(torch.device("cpu")), PeakMemory(torch.device("cpu")).peak())
"""


def test_a_spawned_rank_reports_its_own_peak_not_its_parents():
    """On Linux ``ru_maxrss`` keeps the high-water mark of the process a program was forked
    from (it survives exec), so a rank launched by a large parent reported the parent's peak;
    the CPU peak is this program's own (VmHWM)."""
    import subprocess
    import sys

    ballast = bytearray(1 << 30)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # touch every page: 1 GiB resident
    run = subprocess.run([sys.executable, "-c", _CHILD_PEAK], capture_output=True, text=True,
                         timeout=120, check=True)
    engine_peak, window_peak = map(int, run.stdout.split())
    assert 0 < engine_peak < 1 << 30 and 0 < window_peak < 1 << 30, (engine_peak, window_peak)
    del ballast
