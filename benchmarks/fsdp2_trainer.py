"""The FSDP2 peer: moezero's own Decoder under ``fully_shard``, checkpointed with DCP.

FSDP2 has no expert parallelism, so the model is built with ``ep_size=1`` (every rank runs
all experts) and every parameter, experts included, is sharded over the W ranks: the usual
way to train a MoE with plain FSDP2. Same weights init (by FQN), data, AdamW hyperparameters,
constant lr, clipping at 1.0, fp32.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from benchmarks.common import INIT_STD, make_batches, model_args
from moezero.model.build import build_decoder
from moezero.model.materialize import KeyedInit


class Fsdp2Trainer:
    """``fully_shard`` per decoder block and at the root; ``torch.optim.AdamW``."""

    def __init__(self, spec: dict):
        train, world = spec["train"], dist.get_world_size()
        args = model_args(spec["model"], ep_size=1)
        model = build_decoder(args, where="cpu", init=KeyedInit(train["seed"], INIT_STD))
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train["lr"],
                                           betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        self.batches = make_batches(train, rank=dist.get_rank(), world=world)
        self.save_note = None
        local = sum(p.to_local().numel() for p in self.model.parameters())
        self.info = {"optimizer_elements": local, "step_call": "optimizer.step()",
                     "torch": torch.__version__}

    def step(self, batch_BS1: torch.Tensor) -> tuple[float, float]:
        loss, _ = self.model.loss(batch_BS1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        start = time.perf_counter()
        self.optimizer.step()
        elapsed = time.perf_counter() - start
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), elapsed

    def save(self, folder: str) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)

    def load(self, folder: str) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
