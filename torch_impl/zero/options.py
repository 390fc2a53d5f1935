"""What the optimizers are told about communication and the offloaded step: one frozen object,
built from the ``zero_optimization`` config section by ``ZeroOptions.from_config`` (in
``moezero.zero.build``) and passed to the optimizer; tests and benchmarks pass their own."""

from __future__ import annotations

from dataclasses import dataclass

import torch

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ZeroOptions:
    """Attributes:
        reduce_bucket_size: Elements of one gradient-reduction bucket's send buffer.
        overlap_comm: Launch reduction buckets from gradient hooks during backward.
        reduce_dtype: dtype gradients are summed in across ranks (fp32: bit-identical to an
            fp32 sum; bf16: half the bytes, then upcast for the step).
        allgather_bucket_size: Elements of one parameter all-gather bucket's receive buffer
            (stages 1-3); None: one all-gather per optimizer group.
        host_step: Step the fp32 state on the host, window by window (the ``cpu`` and
            ``nvme`` optimizer offload tiers): gradients copied to the host while the previous
            window steps, one vectorised AdamW per window, masters copied back.
        host_window: Elements of fp32 state in one window of consecutive groups (at least one
            group). Two windows' gradients are alive at a time (on the host: copies, or
            swap reads with the gradient tier); AdamW allocates nothing per element.
        prefetch_max_bytes: Stage 3: the largest unit (bytes of its params) gathered ahead
            of its use (``moezero.zero.gather``; None: any).
        param_read_ahead: Stage 3 with NVMe params: the units ahead of the one being gathered
            whose param shards are read from the swap files in the background (0: each shard
            is read when its gather starts).
        param_keep_for_backward: Stage 3: bytes of the forward's last units kept gathered for
            backward (``moezero.zero.gather``; 0: each released after its forward).
        keep_grads: Stage 3 with the gradient tier: bytes of reduced gradient partitions kept
            in memory rather than in swap files (``moezero.zero.gradtier``; 0: none).
        read_in_backward: NVMe optimizer state: bytes of the step's first windows read during
            the step's last backward (``SwapState.read_early``; 0: read at the step).
        step_in_forward: Stage 3 with NVMe state and params: the step's windows run on a
            background thread behind the next forward, whose gathers wait per group for its
            written master (``Optimizer.finish_step``).
    """

    reduce_bucket_size: int = int(5e7)
    overlap_comm: bool = True
    reduce_dtype: torch.dtype = torch.float32
    allgather_bucket_size: int | None = int(5e7)
    host_step: bool = False
    host_window: int = 1 << 22
    prefetch_max_bytes: int | None = None
    param_read_ahead: int = 2
    param_keep_for_backward: int = 0
    keep_grads: int = 0
    read_in_backward: int = 0
    step_in_forward: bool = False

    @classmethod
    def from_config(cls, zero) -> ZeroOptions:
        """From the ``zero_optimization`` section (``moezero.config.schema.ZeroConfig``)."""
        return cls(reduce_bucket_size=zero.reduce_bucket_size, overlap_comm=zero.overlap_comm,
                   reduce_dtype=REDUCE_DTYPES[zero.reduce_dtype],
                   allgather_bucket_size=zero.allgather_bucket_size,
                   host_step=zero.offload_optimizer.device != "none",
                   prefetch_max_bytes=zero.prefetch_max_bytes,
                   param_read_ahead=zero.offload_param.read_ahead,
                   param_keep_for_backward=zero.offload_param.keep_for_backward,
                   keep_grads=zero.offload_optimizer.keep_grads,
                   read_in_backward=zero.offload_optimizer.read_in_backward,
                   step_in_forward=zero.steps_in_forward)
