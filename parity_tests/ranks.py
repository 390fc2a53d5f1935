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

from moezero.config import Config
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.train import build_model


def _numpy(named) -> dict[str, np.ndarray]:
    return {k: v.detach().clone().float().numpy() for k, v in named.items()}


def one_step(cfg_data: dict, global_batch: np.ndarray) -> dict:
    """Forward, backward and one optimizer step of this rank's slice (collective)."""
    cfg = Config.model_validate(cfg_data)
    # The raw per-rank gradients are only there to read after backward when the reduction
    # does not overlap it (with overlap_comm, gradient hooks reduce buckets in place during
    # backward, at every stage); the step itself is the same either way.
    cfg.zero_optimization.overlap_comm = False
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


def train_and_save(cfg_data: dict, rows: int, steps: int, save_at: int, root: str) -> dict:
    """``steps`` engine train steps of this rank's rows ``[r·rows, (r+1)·rows)`` of the
    synthetic corpus' global batches (``moezero.data.Batches``, the trainer's stream);
    after step ``save_at`` it saves a checkpoint under ``root`` (data position as client state)
    and keeps going: the uninterrupted continuation. Returns every step's metrics (the loss
    is the mean of the ranks' losses) and this rank's fp32 state pieces at the save:
    ``(fqn, start, stop, master, exp_avg, exp_avg_sq)`` from ``Optimizer.state_pieces``.
    """
    from moezero.data import Batches, make_corpus

    cfg = Config.model_validate(cfg_data)
    topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
    data = Batches(make_corpus(None, vocab=cfg.data.synthetic_vocab, sources=2, seed=7),
                   global_batch=rows * topo.world_size, seq_len=cfg.train.seq_len, seed=0,
                   dp_rank=topo.rank, dp_size=topo.world_size)
    metrics, pieces, saved = [], [], None
    for step in range(1, steps + 1):
        metrics.append(engine.train_step([torch.from_numpy(data.next())]))
        if step == save_at:
            saved = str(engine.save_checkpoint(root, state={"data": data.state_dict()}))
            pieces = [(piece.fqn, piece.start, piece.stop,
                       *(views[k].clone().numpy() for k in ("master", "exp_avg", "exp_avg_sq")))
                      for piece, views in engine.optimizer.state_pieces()]
    return {"rank": topo.rank, "metrics": metrics, "pieces": pieces, "saved": saved,
            "step_count": engine.step_count}
