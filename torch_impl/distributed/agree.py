"""Small agreements over the world group, as JSON: rank 0's value on every rank (the run
directory: ``moezero train`` under torchrun starts one CLI per rank, each of which would pick
its own ``runs/<timestamp>``) and every rank's value (the digest of each rank's optimizer
plan, compared at start-up). Tensors live on the caller's ``device`` (CUDA under NCCL); no
pickle. Outside a process group (or at W = 1) each returns this process's value.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

__all__ = ["all_gather_json", "broadcast_json"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _encode(obj, device) -> torch.Tensor:
    data = bytearray(json.dumps(obj).encode())
    return torch.frombuffer(data, dtype=torch.uint8).to(device) if data else \
        torch.empty(0, dtype=torch.uint8, device=device)


def broadcast_json(obj, *, device: torch.device | str = "cpu"):
    """Rank 0's JSON-able ``obj`` on every rank (collective)."""
    if not _distributed():
        return obj
    data = _encode(obj, device) if dist.get_rank() == 0 else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buf = data if data is not None else torch.empty(int(size.item()), dtype=torch.uint8,
                                                    device=device)
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.cpu().numpy()))


def all_gather_json(obj, *, device: torch.device | str = "cpu") -> list:
    """Every rank's JSON-able ``obj``, in rank order (collective)."""
    if not _distributed():
        return [obj]
    world = dist.get_world_size()
    data = _encode(obj, device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    cap = max(int(s.item()) for s in sizes)
    buf = torch.zeros(cap, dtype=torch.uint8, device=device)
    buf[:data.numel()] = data
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf)
    return [json.loads(bytes(o[:int(s.item())].cpu().numpy())) for o, s in zip(out, sizes, strict=True)]
