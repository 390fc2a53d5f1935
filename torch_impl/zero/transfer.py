"""Copies between the compute device and host memory for the offloaded tiers.

On CUDA every copy is non-blocking on one side stream, between device memory and pinned host
memory, and ordered by events: the side stream waits for the compute stream before it reads
what the compute stream produced (a gradient, a parameter's old storage); the host waits for a
window's device-to-host copies (``Staged.wait``) before stepping it; the compute stream waits
for the side stream (``finish``, or per fetched tensor) before it reads what was copied in.
Device-to-host copies of window g+1 so run while the host steps window g, and host-to-device
copies of the updated masters while it steps the next. Without CUDA (or for tensors already
where they are going) they are plain copies: nothing to overlap, nothing to pin (CPU builds of
torch refuse ``pin_memory``). Used by ``moezero.zero.optimizer`` and ``moezero.zero.sharded``,
and by the engine for its micro-batches (``batch_to_device``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moezero.memory.pinned import PinnedPool


def batch_to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A micro-batch on the compute device: on CUDA pinned, then copied non-blocking on the
    compute stream (a copy from pageable memory would make the host wait for all queued GPU
    work, the previous micro-batch's backward included); a plain ``to`` elsewhere."""
    if device.type != "cuda" or batch.is_cuda:
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


@dataclass(eq=False)
class Staged:
    """Host copies in flight: ``wait`` returns them once the copies are done."""

    tensors: list[torch.Tensor]
    event: object | None = None  # torch.cuda.Event recorded after the copies

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.tensors


class HostTransfer:
    """Device <-> host copies of the offloaded step and the stage-3 param fetch.

    Args:
        device: The compute device (the params'); a side stream is made when it is CUDA.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.pool = PinnedPool() if self.cuda else None  # exact-size pinned buffers, reused

    @property
    def pin(self) -> bool:
        """Whether host buffers should be pinned (only with CUDA)."""
        return self.cuda

    def to_host(self, tensors: list[torch.Tensor]) -> Staged:
        """Host copies of ``tensors``: CUDA tensors into pinned buffers of the pool, in flight on the
        side stream after the compute stream's work so far; host tensors as they are (no copy,
        no stream: ``record_stream`` has only a CUDA kernel)."""
        if not (self.cuda and any(t.is_cuda for t in tensors)):
            return Staged([t.cpu() for t in tensors])
        compute = torch.cuda.current_stream(self.device)
        out = []
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)
            for t in tensors:
                if not t.is_cuda:  # already on the host (the NVMe gradient tier's): no stream
                    out.append(t)
                    continue
                host = self.pool.take(t.numel(), t.dtype).view(t.shape)
                host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # not reused by the allocator before the copy
                out.append(host)
            done = torch.cuda.Event()
            done.record(self.stream)
        return Staged(out, done)

    def pinned_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t``: pinned from the pool with CUDA, plain otherwise."""
        if self.pool is None:
            return t.cpu()
        return self.pool.take(t.numel(), t.dtype).view(t.shape).copy_(t)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``: host to CUDA non-blocking on the side stream (after the compute
        stream's work so far, which may still read ``dst``); plain otherwise. A dtype change
        (an fp32 master into bf16 params) is made on the device, after an fp32 copy, so the
        transfer stays asynchronous. What reads ``dst`` on the compute stream must come after
        ``finish``."""
        if not (self.cuda and dst.is_cuda and not src.is_cuda):
            dst.copy_(src)
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            if src.dtype == dst.dtype:
                dst.copy_(src, non_blocking=True)
            else:  # the temporary lives and dies on the side stream
                dst.copy_(src.to(self.device, non_blocking=True))

    def fetch(self, src: torch.Tensor) -> torch.Tensor:
        """``src`` on the compute device: a host tensor is copied non-blocking on the side
        stream and the compute stream waits for that copy only (the host does not)."""
        if not (self.cuda and not src.is_cuda):
            return src.to(self.device)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = src.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)
        out.record_stream(compute)  # allocated on the side stream, used on the compute stream
        return out

    def finish(self) -> None:
        """The compute stream waits for every copy issued so far (not the host)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
