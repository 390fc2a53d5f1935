"""Distributed equals single-process: W=2 (ep 1, 2; ZeRO stages 0, 1, 2) vs W=1 on the same
global batch (fp32)."""

from __future__ import annotations

import pytest
import torch

from moezero.config import Config
from moezero.data import Batches, make_corpus
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.train import build_model
from tests.support.compare import assert_close_by_fqn, rel_err
from tests.support.world import run_world
from tests.torch_impl.tolerances import RTOL

MICRO = 2  # sequences per rank


def small_config(**moe) -> Config:
    cfg = Config()
    cfg.model = cfg.model.model_copy(update={"dim": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 48})
    cfg.train = cfg.train.model_copy(update={"seq_len": 16, "micro_batch_size": MICRO, "steps": 4})
    cfg.moe = cfg.moe.model_copy(update={"num_experts": 4, **moe})
    cfg.precision.dtype = "fp32"
    return cfg


def one_step(cfg_data: dict, world_of_batch: int, stage: int = 0) -> dict:
    """Forward/backward the global batch split over this run's ranks (or looped at W=1)."""
    cfg = Config.model_validate(cfg_data)
    cfg.zero_optimization.stage = stage
    topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    cfg.train.grad_accum_steps = world_of_batch // topo.world_size
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
    corpus = make_corpus(None, vocab=32, sources=2, seed=7)
    batches = Batches(corpus, global_batch=MICRO * world_of_batch, seq_len=cfg.train.seq_len,
                      seed=3, dp_rank=0, dp_size=1)
    slices = torch.from_numpy(batches.next()).split(MICRO)
    mine = slices[topo.rank::topo.world_size] if topo.world_size > 1 else slices
    losses = []
    for batch in mine:
        loss, _ = engine.forward(batch)
        engine.backward(loss)
        losses.append(loss.item())
    engine.reduce_gradients()
    grads = {k: g.clone().numpy() for k, g in engine.gradients().items()}
    engine.optimizer_step()
    params = {k: p.detach().clone().numpy() for k, p in engine.params.items()}
    return {"losses": losses, "grads": grads, "params": params}


def each_stage(cfg_data: dict, world_of_batch: int, stages: tuple[int, ...]) -> dict:
    """``one_step`` for each ZeRO stage, in one world (spawning ranks is the slow part)."""
    return {stage: one_step(cfg_data, world_of_batch, stage) for stage in stages}


def merged(results: list[dict], key: str) -> dict:
    out = {}
    for r in results:
        out.update(r[key])
    return out


@pytest.mark.parametrize("ep,capacity,stages", [(2, None, (0, 1, 2)), (1, None, (0, 1, 2)),
                                                (2, 1.0, (0, 2))])
def test_w2_equals_w1(tmp_path, ep, capacity, stages):
    cfg = small_config(ep_size=ep, capacity_factor=capacity)
    by_rank = run_world(each_stage, 2, tmp_path, cfg.model_dump(by_alias=True), 2, stages)
    single_cfg = small_config(ep_size=1, capacity_factor=capacity)
    (single,) = run_world(one_step, 1, tmp_path, single_cfg.model_dump(by_alias=True), 2)
    single_loss = sum(single["losses"]) / 2
    for stage in stages:
        dist_res = [r[stage] for r in by_rank]
        dist_loss = sum(r["losses"][0] for r in dist_res) / 2
        assert rel_err(dist_loss, single_loss) <= RTOL["fp32"]
        assert_close_by_fqn(merged(dist_res, "grads"), single["grads"], RTOL["fp32"])
        assert_close_by_fqn(merged(dist_res, "params"), single["params"], RTOL["fp32"])
        # experts really were split across the two ranks
        if ep == 2:
            assert len(dist_res[0]["grads"]) < len(single["grads"])
