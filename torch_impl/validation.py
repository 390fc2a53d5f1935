"""Validation loss: the mean next-token cross-entropy on held-out batches, over all ranks.

Every rank evaluates its rows of the same ``train.eval_batches`` global validation batches
(``val_batch(j)`` of the data stream: held-out documents of a prepared dataset, the held-out
tail of a text file, fresh draws of the synthetic corpus), so each evaluation scores the same
tokens and the numbers are comparable along a run. No gradients; MoE load telemetry paused.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.distributed as dist


def evaluate(engine, batches, num_batches: int, load=None) -> dict:
    """``{"val_loss": mean CE in nats/token, "val_ppl": exp(val_loss)}`` (collective)."""
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    with torch.no_grad(), load.paused() if load is not None else nullcontext():
        for j in range(num_batches):
            _, parts = engine.forward(torch.from_numpy(batches.val_batch(j)))
            total += parts["ce"].double()
    total /= num_batches
    if engine.topology.distributed:
        dist.all_reduce(total)
        total /= engine.topology.world_size
    loss = total.item()
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
