"""The one place that picks the optimizer for ``zero_optimization.stage``: the replicated one
(stage 0) or the sharded one (stages 1-3), both behind ``moezero.zero.optimizer.Optimizer``."""

from __future__ import annotations

import torch
from torch import nn

from moezero.distributed.topology import Topology
from moezero.zero.groups import OptimizerGroups
from moezero.zero.optimizer import Optimizer
from moezero.zero.options import ZeroOptions
from moezero.zero.replicated import ReplicatedOptimizer
from moezero.zero.sharded import ShardedOptimizer


def build_optimizer(params: dict[str, nn.Parameter], groups: OptimizerGroups,
                    topology: Topology, zero, *, model: nn.Module,
                    swap_factory=None, initial=None) -> Optimizer:
    """The optimizer of ``params`` for ``zero`` (the ``zero_optimization`` config section).

    ``swap_factory(slots, meter)`` builds the NVMe swap files (``moezero.offload.state.build``;
    handed in, so this layer never imports ``offload``); stage 0 takes no offload.
    ``initial(fqn)``: stage 3 only, each param's initial value when the params have no storage
    yet (sharded construction, ``moezero.model.materialize``).
    """
    options = ZeroOptions.from_config(zero)
    if zero.stage == 0:
        return ReplicatedOptimizer(params, groups, topology, options)
    device = next(iter(params.values())).device
    host = torch.device("cpu")
    return ShardedOptimizer(
        params, groups, topology, options, stage=zero.stage, model=model,
        state_device=host if zero.offload_optimizer.device != "none" else device,
        param_device=host if zero.offload_param.device != "none" else device,
        swap_factory=swap_factory, initial=initial)
