"""The optimizer applies each group's learning rate (issue 15, item 7): with
``optimizer.expert_lr`` and ``optimizer.router_lr`` set, one AdamW step from fresh moments moves
every element by ``lr_of_its_param * g / (|g| + eps)`` (Adam's first update, no weight decay,
no clipping), computed here from the reduced gradients, at ZeRO stages 0 to 3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moezero.config import Config
from moezero.model.moe import expert_tag
from moezero.train import setup
from tests.torch_impl.test_distributed import small_config

LR, EXPERT_LR, ROUTER_LR, EPS = 1e-2, 3e-3, 5e-2, 1e-8


def lr_config(stage: int) -> Config:
    cfg = small_config(ep_size=1)
    cfg.zero_optimization.stage = stage
    opt = cfg.optimizer
    opt.lr, opt.expert_lr, opt.router_lr, opt.eps = LR, EXPERT_LR, ROUTER_LR, EPS
    opt.weight_decay, opt.gradient_clipping, opt.warmup_steps = 0.0, 0.0, 0
    return cfg


def expected_lr(fqn: str, param) -> float:
    if expert_tag(param) is not None:
        return EXPERT_LR
    return ROUTER_LR if fqn.endswith("router.weight") else LR


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_expert_and_router_lr_scale_the_applied_update(stage):
    engine, batches = setup(lr_config(stage), torch.device("cpu"))
    assert engine.current_lr() == LR  # step 0 of a schedule without warmup
    before = {k: v.detach().clone().double() for k, v in engine.full_parameters().items()}
    loss, _ = engine.forward(torch.from_numpy(batches.next()))
    engine.backward(loss)
    engine.reduce_gradients()
    grads = {k: g.detach().clone().double() for k, g in engine.gradients().items()}
    metrics = engine.optimizer_step()
    assert not metrics["skipped"]
    after = {k: v.detach().double() for k, v in engine.full_parameters().items()}
    kinds = set()
    for fqn, param in engine.params.items():
        lr = expected_lr(fqn, param)
        kinds.add(lr)
        g = grads[fqn]
        want = -lr * g / (g.abs() + EPS)
        got = after[fqn] - before[fqn]
        moved = g.abs() > 1e-6  # noise-level gradients: Adam's first step is ill-conditioned
        assert moved.any(), fqn
        err = (got - want)[moved].abs().max().item()
        assert err <= 1e-6 * lr + 1e-7, (fqn, lr, err)
        ratio = np.median((got[moved] / want[moved]).numpy())
        assert abs(ratio - 1) < 1e-3, (fqn, ratio)
    assert kinds == {LR, EXPERT_LR, ROUTER_LR}
