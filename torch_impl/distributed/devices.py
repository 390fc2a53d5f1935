"""Which device each local rank computes on, and the backend that goes with it.

One rule (docs/model.md, "CUDA"): NCCL ranks get one CUDA device each, local rank ``r`` on
device ``r % device_count`` (under torchrun with ``CUDA_VISIBLE_DEVICES`` narrowed to one
device per process, every rank sees its own device as ``cuda:0``); gloo ranks keep every
tensor on the host, also on a GPU machine (gloo has no CUDA reduce-scatter). Spawning more
NCCL ranks than devices is refused in one line: two NCCL ranks cannot share a device.
``plan_devices`` is pure (the CUDA facts are arguments); ``place_rank`` and ``rank_device``
apply it inside a rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BACKENDS = ("auto", "gloo", "nccl")


class DeviceError(ValueError):
    """A rank layout this machine cannot run: the option to change (``key``) and why."""

    def __init__(self, key: str, problem: str):
        self.key, self.problem = key, problem
        super().__init__(f"{key}: {problem}")


@dataclass(frozen=True)
class DevicePlan:
    """The resolved backend and each local rank's device (``"cpu"`` or ``"cuda:i"``)."""

    backend: str
    devices: tuple[str, ...]


def resolve_backend(backend: str, device_count: int) -> str:
    """``auto``: NCCL when a CUDA device is visible, else gloo."""
    if backend not in BACKENDS:
        raise DeviceError("dist.backend", f"{backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "nccl" if device_count > 0 else "gloo"
    return backend


def default_nproc(backend: str, device_count: int) -> int:
    """``moezero train``'s rank count without ``--nproc``: one per CUDA device under NCCL,
    else 2."""
    return device_count if resolve_backend(backend, device_count) == "nccl" else 2


def plan_devices(nproc: int, backend: str, device_count: int,
                 visible: str | None = None) -> DevicePlan:
    """The backend and devices of ``nproc`` local ranks.

    Args:
        nproc: Ranks on this machine (spawned, or torchrun's ``LOCAL_WORLD_SIZE``).
        backend: ``dist.backend`` (``auto``, ``gloo`` or ``nccl``).
        device_count: CUDA devices this process sees (0 without CUDA).
        visible: ``CUDA_VISIBLE_DEVICES`` as each rank got it from torchrun, or None (spawned
            ranks inherit the parent's, so it never narrows them to one device each).

    Raises:
        DeviceError: NCCL without a device, or more NCCL ranks than devices.
    """
    resolved = resolve_backend(backend, device_count)
    if resolved == "gloo":
        return DevicePlan("gloo", ("cpu",) * nproc)
    if device_count < 1:
        raise DeviceError("dist.backend", "nccl needs a CUDA device and none is visible "
                          "here; use --set dist.backend=gloo")
    one_each = device_count == 1 and visible is not None and len(visible.split(",")) == 1
    if nproc > device_count and not one_each:
        raise DeviceError("--nproc", f"{nproc} NCCL ranks need {nproc} CUDA devices, this machine "
                          f"has {device_count}; use --nproc {device_count} (the default) or "
                          "--set dist.backend=gloo (CPU)")
    return DevicePlan("nccl", tuple(f"cuda:{r % device_count}" for r in range(nproc)))


def cuda_device_count() -> int:
    """CUDA devices visible to this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def compute_device(backend: str, device_count: int) -> torch.device:
    """The kind of device ranks compute on (no index): CUDA under NCCL, else the CPU."""
    return torch.device("cuda" if resolve_backend(backend, device_count) == "nccl" else "cpu")


def place_rank(backend: str, local_rank: int) -> None:
    """Make this rank's CUDA device current (NCCL only; gloo ranks stay on the host)."""
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def rank_device(backend: str) -> torch.device:
    """This rank's compute device once ``place_rank`` ran: its CUDA device under NCCL (also a
    lone rank without a process group), else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
