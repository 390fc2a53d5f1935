"""Validation loss: the mean next-token cross-entropy on held-out batches, over all ranks.

Masked targets (a chat dataset's prompts) count for nothing: the loss is the sum over trained
targets of all ranks and batches over their count. Every rank evaluates its rows of the same ``train.eval_batches`` global validation batches
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
    """``{"val_loss": CE in nats per trained token, "val_ppl": exp(val_loss)}`` (collective):
    the sum over every rank's trained targets of ``num_batches`` batches over their count."""
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)  # Σ CE, trained targets
    with torch.no_grad(), load.paused() if load is not None else nullcontext():
        for j in range(num_batches):
            _, parts = engine.forward(batches.val_micro_batch(j))
            trained = parts["trained"].double()
            total += torch.stack([parts["ce"].double() * trained, trained])
    if engine.topology.distributed:
        dist.all_reduce(total)
    loss = (total[0] / total[1].clamp(min=1)).item()
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
