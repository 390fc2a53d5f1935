"""What each torch rank runs in the distributed parity tests (torch only: spawned ranks import
this module, never JAX).

A rank builds its part of the model (its EP rank's experts, ``init_weights`` keyed by FQN),
wraps it with ``initialize``, takes rows ``[r·b, (r+1)·b)`` of the global batch, and reports
its loss, the assignments its capacity dropped, its raw (unreduced) gradients, the step's global grad norm and its params before and
after one optimizer step, all as numpy keyed by FQN.
"""

from __future__ import annotations

import numpy as np
import torch

from torch_impl.config import Config
from torch_impl.engine import initialize
from torch_impl.parallel import build_topology
from torch_impl.train import build_model


def _numpy(named) -> dict[str, np.ndarray]:
    return {k: v.detach().clone().float().numpy() for k, v in named.items()}


def one_step(cfg_data: dict, global_batch: np.ndarray) -> dict:
    """Forward, backward and one optimizer step of this rank's slice (collective)."""
    cfg = Config.model_validate(cfg_data)
    topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    model = build_model(cfg, topo)
    engine = initialize(model, cfg, topology=topo, device="cpu")
    b = global_batch.shape[0] // topo.world_size
    mine = torch.from_numpy(global_batch[topo.rank * b:(topo.rank + 1) * b])
    before = _numpy(engine.params)
    loss, _ = engine.forward(mine)
    engine.backward(loss)
    dropped = sum(int(layer.moe.last_stats["dropped"]) for layer in model.layers)
    grads = _numpy({k: torch.zeros_like(p) if p.grad is None else p.grad
                    for k, p in engine.params.items()})
    metrics = engine.step()
    return {"loss": loss.item(), "dropped": dropped, "grads": grads, "grad_norm": metrics["grad_norm"],
            "params_before": before, "params_after": _numpy(engine.params)}


def each_config(configs: list[dict], global_batch: np.ndarray) -> list[dict]:
    """``one_step`` for every config in one world (spawning ranks is the slow part)."""
    return [one_step(c, global_batch) for c in configs]
