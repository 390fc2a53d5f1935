"""DeepSpeed's ``.pt`` files read without executing code from them.

They are pickles. Each is read with ``torch.load(weights_only=True, mmap=True)`` and an
explicit allowlist: the few DeepSpeed types the 0.19 files hold, each replaced by a plain
stand-in that only keeps its fields (DeepSpeed is never imported). Any other global is found
before loading (``get_unsafe_globals_in_checkpoint`` only scans the pickle's opcodes) and
refused in one line naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moezero.plan.store import CheckpointError


class Fields:
    """A stand-in for a DeepSpeed object: its pickled fields as attributes, nothing else."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({vars(self)})"


class LossScaler(Fields):
    """``deepspeed.runtime.fp16.loss_scaler.LossScaler`` / ``DynamicLossScaler``."""


class FragmentAddress(Fields):
    """``deepspeed.utils.tensor_fragment.fragment_address`` (numel, start)."""


class ZeroStage(int):
    """``deepspeed.runtime.zero.config.ZeroStageEnum``: the stage number."""


ALLOWED = (
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
)
"""The non-tensor types of DeepSpeed 0.19's checkpoints (stand-in, pickled name)."""


def load(path: Path) -> dict:
    """The object in ``path`` (tensors memory-mapped, so a file's data is read on use).

    Raises:
        CheckpointError: one line naming the file: a global outside the allowlist, a file that
            is not a readable torch zip (truncated, empty, ...), or not a dict.
    """
    with torch.serialization.safe_globals(list(ALLOWED)):
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception as exc:
            raise CheckpointError(f"{path}: not a readable torch checkpoint ({_first(exc)})") \
                from None
        if unsafe:
            raise CheckpointError(f"{path}: refusing to load: the pickle asks for {unsafe[0]}, "
                                  "which is not on the allowlist of DeepSpeed's types")
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise CheckpointError(f"{path}: not a readable torch checkpoint ({_first(exc)})") \
                from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a DeepSpeed state dict")
    return obj


def _first(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
