"""Activation checkpointing (torch_impl/model/recompute.py): on CPU fp32, every step's loss and
grad norm and the final parameters are bit-identical to the same run without it, at ZeRO
stages 0-3, ep 1 and 2, with and without overlap_comm, with stage-3 params on NVMe, every
block or every second block checkpointed, at W = 1 and 2; with an expert bias (softmax and
sigmoid routing) the recomputed forward routes as the plain one and counts the expert loads once;
telemetry counts each forward once; and the activations kept for backward shrink."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from moezero.config import Config
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.model.recompute import checkpoint_blocks
from moezero.model.router import biased_routers
from moezero.telemetry import ExpertLoad
from moezero.train import build_model
from tests.support.saved import saved_storages
from tests.support.world import run_world
from tests.torch_impl.test_distributed import MICRO
from tests.torch_impl.test_estimate import case
from tests.torch_impl.test_zero import engine_and_batches

STEPS = 3
EVERY = (1, 2)  # every block; every second block (blocks 0, 2, ...)
REPEATS = 3  # stage 2 with overlap_comm: the configuration once seen to differ, rerun


def with_ac(cfg: dict, every: int) -> dict:
    return {**copy.deepcopy(cfg), "activation_checkpointing": {"enabled": True, "every_n_layers": every}}


def overlap(cfg: dict, on: bool) -> dict:
    cfg["zero_optimization"]["overlap_comm"] = on
    return cfg


def train(cfg_data: dict, steps: int = STEPS) -> dict:
    """Optimizer steps on this rank's slices of the global batch: losses, grad norms, params."""
    engine, topo, batches = engine_and_batches(cfg_data, 2)
    losses, norms = [], []
    for _ in range(steps):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        metrics = engine.train_step(list(slices[topo.rank::topo.world_size]))
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    params = {k: p.detach().float().clone().numpy() for k, p in engine.full_parameters().items()}
    biases = {k: b.clone().numpy() for k, b in engine.model.named_buffers()
              if k.endswith("expert_bias")}
    engine.close()
    return {"losses": losses, "norms": norms, "params": params, "biases": biases}


def runs(cases: list[dict]) -> list[dict]:
    return [train(c) for c in cases]


def with_and_without(bases: list[dict]) -> list[dict]:
    """Each base, then the base with every ``EVERY`` of checkpointing."""
    return [c for base in bases for c in (base, *(with_ac(base, n) for n in EVERY))]


def assert_same(got: dict, want: dict) -> None:
    assert got["losses"] == want["losses"]
    assert got["norms"] == want["norms"]
    assert got["params"].keys() == want["params"].keys()
    for fqn, value in want["params"].items():
        assert np.array_equal(got["params"][fqn], value), fqn
    assert got["biases"].keys() == want["biases"].keys()
    for fqn, value in want["biases"].items():
        assert np.array_equal(got["biases"][fqn], value), fqn


def assert_runs_same(results: list[dict]) -> None:
    """``results`` of ``with_and_without``: every checkpointed run equals its base."""
    size = 1 + len(EVERY)
    for i in range(0, len(results), size):
        for ac in results[i + 1:i + size]:
            assert_same(ac, results[i])


def world_bases(stage: int, nvme: str) -> list[dict]:
    """W = 2: ep 1 and 2, overlap_comm on and off; at stage 3 also params on NVMe."""
    bases = [overlap(case(stage, ep=ep), on) for ep in (1, 2) for on in (True, False)]
    if stage == 3:
        bases += [overlap(case(3, ep=2, param="nvme", nvme=nvme), on) for on in (True, False)]
    if stage == 2:
        bases += [overlap(case(2, ep=2, cap=200), True) for _ in range(REPEATS)]
    return bases


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow),
                                   pytest.param(1, marks=pytest.mark.slow), 2, 3])
def test_bit_identical_at_w2(tmp_path, stage):
    cases = with_and_without(world_bases(stage, str(tmp_path)))
    for rank in run_world(runs, 2, tmp_path, cases, timeout_s=300):
        assert_runs_same(rank)


@pytest.mark.parametrize("stage", [0, 3])
def test_bit_identical_at_w1(tmp_path, stage):
    bases = [case(stage)]
    if stage == 3:
        bases.append(case(3, param="nvme", nvme=str(tmp_path)))
    assert_runs_same(runs(with_and_without(bases)))


def test_bit_identical_at_w1_with_expert_bias_and_sigmoid_routing():
    """Steps with the expert bias updated from the step's loads (counted once either way)."""
    bases = [{**case(0), "moe": {**case(0)["moe"], **moe}} for moe in BIASED_ROUTERS.values()]
    results = runs(with_and_without(bases))
    assert_runs_same(results)
    assert all(r["biases"] and all(b.any() for b in r["biases"].values()) for r in results)


def test_blocks_are_wrapped_from_outside_and_recompute_in_backward():
    cfg = Config.model_validate(case(0))
    topo = build_topology([1], num_experts=cfg.moe.num_experts)
    model = build_model(cfg, topo)
    fqns = [n for n, _ in model.named_parameters()]
    assert checkpoint_blocks(model, 2) == [f"layers.{i}" for i in range(0, cfg.model.n_layers, 2)]
    assert [n for n, _ in model.named_parameters()] == fqns
    calls = []
    model.layers[0].attn.register_forward_hook(lambda *a: calls.append(1))
    model.loss(torch.randint(0, 32, (2, 9)))[0].backward()
    assert len(calls) == 2  # forward, then its recomputation in backward
    with pytest.raises(ValueError, match="every_n_layers"):
        checkpoint_blocks(model, 0)


def test_stage3_holds_no_group_after_a_checkpointed_step():
    cfg = Config.model_validate(with_ac(case(3), 1))
    topo = build_topology([1], num_experts=cfg.moe.num_experts)
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
    engine.train_step([torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))])
    gatherer = engine.optimizer.gatherer
    assert not any(gatherer.state.refs)
    assert not gatherer.state.resident
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.params.values())
    engine.close()


def test_telemetry_counts_each_forward_once():
    counts = []
    for enabled in (False, True):
        cfg = Config.model_validate(case(0))
        cfg.activation_checkpointing.enabled = enabled
        topo = build_topology([1], num_experts=cfg.moe.num_experts)
        engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
        load = ExpertLoad(engine.model, engine.device)
        engine.train_step([torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))])
        counts.append(load.collect(False))
    assert counts[0] == counts[1]


def saved_activation_bytes(every: int | None, layers: int = 8) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for backward after one
    forward of a ``layers``-block model (checkpointed blocks keep only their inputs)."""
    cfg = Config.model_validate(case(0))
    cfg.model.n_layers = layers
    model = build_model(cfg, build_topology([1], num_experts=cfg.moe.num_experts))
    if every is not None:
        checkpoint_blocks(model, every)
    tokens = torch.randint(0, 32, (4, 33), generator=torch.Generator().manual_seed(0))
    with saved_storages(model) as kept:
        loss, _ = model.loss(tokens)
    loss.backward()
    return sum(kept.values())


def test_checkpointing_keeps_fewer_activations():
    plain, every, second = (saved_activation_bytes(n) for n in (None, 1, 2))
    assert every < second < plain
    assert every * 4 < plain  # 8 blocks: each keeps its input instead of its activations


BIASED_ROUTERS = {
    "softmax": {"expert_bias": True},
    "sigmoid": {"expert_bias": True, "router_scoring": "sigmoid", "renormalize": False},
}


def biased_step(moe: dict, every: int | None) -> dict:
    """One forward and backward of a model whose routers carry a random expert bias (large
    enough to decide the choice), checkpointed every ``every`` blocks (None: plain): the loss,
    the gradients and each router's pending expert loads."""
    cfg = Config.model_validate(case(0))
    cfg.moe = cfg.moe.model_copy(update=moe)
    model = build_model(cfg, build_topology([1], num_experts=cfg.moe.num_experts))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for router in biased_routers(model):
            router.expert_bias.copy_(0.05 * torch.randn(router.num_experts, generator=gen))
    if every is not None:
        checkpoint_blocks(model, every)
    loss, _ = model.loss(torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(0)))
    loss.backward()
    return {"loss": loss.item(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "loads": [r.pending_load.clone() for r in biased_routers(model)]}


@pytest.mark.parametrize("scoring", sorted(BIASED_ROUTERS))
@pytest.mark.parametrize("every", EVERY)
def test_recompute_with_expert_bias_equals_the_plain_forward(scoring, every):
    plain = biased_step(BIASED_ROUTERS[scoring], None)
    ac = biased_step(BIASED_ROUTERS[scoring], every)
    assert plain["loads"] and all(int(load.sum()) == 4 * 16 * 2 for load in plain["loads"])
    for i, (got, want) in enumerate(zip(ac["loads"], plain["loads"], strict=True)):
        assert torch.equal(got, want), f"layer {i}: loads {got.tolist()} != {want.tolist()}"
    assert ac["loss"] == plain["loss"]
    assert ac["grads"].keys() == plain["grads"].keys()
    for fqn, grad in plain["grads"].items():
        assert torch.equal(ac["grads"][fqn], grad), fqn
