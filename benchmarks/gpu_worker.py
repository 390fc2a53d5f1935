"""One row of ``benchmarks.gpu`` in this process: build, train, measure, write JSON.

``python -m benchmarks.gpu_worker SPEC.json RESULT.json``. The process joins a process group
of size 1 (NCCL on CUDA, gloo on CPU for the smoke run) through a FileStore in the work
folder, then trains ``warmup + timed`` steps of one micro-batch each. moezero rows go through
the library path a user takes (config -> ``moezero.train.setup`` -> engine); the FSDP2 row
wraps the same ``Decoder`` (grouped experts, all local) in ``fully_shard`` per block.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import INIT_STD, make_batches, model_args, peak_rss


def _device(spec: dict) -> torch.device:
    return torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")


def _overrides(spec: dict) -> list[str]:
    m, t = spec["model"], spec["train"]
    values = {**{f"model.{k}": m[k] for k in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim")},
              "moe.num_experts": m["num_experts"], "moe.top_k": m["top_k"], "moe.ep_size": 1,
              "train.micro_batch_size": t["micro_batch_size"], "train.seq_len": t["seq_len"],
              "train.seed": t["seed"], "train.steps": t["warmup"] + t["timed"],
              "optimizer.lr": t["lr"], "optimizer.warmup_steps": 0, "optimizer.min_lr_ratio": 1.0,
              "precision.dtype": spec["dtype"], **spec["options"]}
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]


class MoezeroRow:
    def __init__(self, spec: dict, device: torch.device):
        from moezero.config import load_config
        from moezero.model.moe import MoE
        from moezero.train import setup

        self.engine, self.batches = setup(load_config(None, _overrides(spec)), device)
        for module in self.engine.model.modules():
            if isinstance(module, MoE) and not spec.get("grouped", True):
                module.grouped = False

    def step(self) -> float:
        return self.engine.train_step([torch.from_numpy(self.batches.next())])["loss"]

    def close(self) -> None:
        self.engine.close()


class Fsdp2Row:
    def __init__(self, spec: dict, device: torch.device):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from moezero.model.build import build_decoder
        from moezero.model.materialize import KeyedInit

        args = model_args(spec["model"], ep_size=1)
        model = build_decoder(args, where="cpu", init=KeyedInit(spec["train"]["seed"], INIT_STD))
        model.to(device)
        mesh = init_device_mesh(device.type, (1,))
        dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        self.model = fully_shard(model, mesh=mesh, mp_policy=policy)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec["train"]["lr"],
                                           betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                           fused=device.type == "cuda")
        self.batches = make_batches(spec["train"], rank=0, world=1)
        self.device = device

    def step(self) -> float:
        loss, _ = self.model.loss(torch.from_numpy(self.batches.next()).to(self.device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def close(self) -> None:
        pass


def run(spec: dict) -> dict:
    """Train the row's steps; tokens/s from the median timed step (each ends in a sync)."""
    device = _device(spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    row = (MoezeroRow if spec["system"] == "moezero" else Fsdp2Row)(spec, device)
    train, losses, times = spec["train"], [], []
    for i in range(train["warmup"] + train["timed"]):
        start = time.perf_counter()
        losses.append(row.step())  # a Python float: the step has finished on the device
        if i >= train["warmup"]:
            times.append(time.perf_counter() - start)
    row.close()
    tokens = train["micro_batch_size"] * train["seq_len"]
    return {"status": "ok", "step_s": statistics.median(times),
            "tokens_per_s": tokens / statistics.median(times), "losses": losses,
            "cuda_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "host_peak_rss": peak_rss()}


def main(spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    store = dist.FileStore(str(Path(spec_path).with_suffix(".store")), 1)
    dist.init_process_group("nccl" if spec["device"] == "cuda" else "gloo", store=store,
                            rank=0, world_size=1)
    try:
        result = run(spec)
    finally:
        dist.destroy_process_group()
    Path(result_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
