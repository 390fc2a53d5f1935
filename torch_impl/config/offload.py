"""The offload sections of ``zero_optimization``: where ZeRO state lives (DeepSpeed's
``offload_optimizer`` / ``offload_param``) and what the NVMe tiers keep in memory or read early
(docs/offload.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moezero.config.errors import FieldError
from moezero.config.section import Section as _Section


def _byte_budget(description: str):
    """A byte budget of the NVMe tiers: at least 0, off (0) by default; the three budgets of
    docs/offload.md share this rule."""
    return Field(0, ge=0, description=description)


class OffloadConfig(_Section):
    """Where a ZeRO state lives (DeepSpeed's ``offload_optimizer`` / ``offload_param``)."""

    device: Literal["none", "cpu", "nvme"] = Field("none", description="none = accelerator memory.")
    nvme_path: str | None = Field(None, description="Folder for swap files; required for nvme.")

    @model_validator(mode="after")
    def _nvme(self) -> OffloadConfig:
        if self.device == "nvme" and not self.nvme_path:
            raise FieldError("nvme_path", "required when device is 'nvme'")
        return self


class ParamOffloadConfig(OffloadConfig):
    """Where stage-3 parameter shards live, and how far ahead NVMe reads run."""

    read_ahead: int = Field(
        2, ge=0,
        description="With device nvme: the next units (in forward order; in backward, reverse) "
                    "whose param shards are read from their swap files while earlier units "
                    "compute, so a gather finds them in memory. Host buffers: at most this "
                    "many units' shards. 0 = read each shard when its gather starts.")
    keep_for_backward: int = _byte_budget(
        "Stage 3: bytes of the forward's last gather units kept gathered "
        "for the start of backward (which needs them first) instead of "
        "released and fetched again; 0 = release each after its forward.")


class OptimizerOffloadConfig(OffloadConfig):
    """Where the optimizer state lives, and how much of the gradients skips the swap files."""

    keep_grads: int = _byte_budget(
        "Stage 3 with device nvme: bytes of reduced gradient partitions "
        "kept in memory from backward to the step instead of written to "
        "and read back from their swap files (the first to land); 0 = all.")
    read_in_backward: int = _byte_budget(
        "With device nvme: bytes of the step's first windows of optimizer "
        "state (master, moments) read from their swap files during the "
        "step's last backward instead of at the step; 0 = at the step.")
    step_in_forward: bool | None = Field(
        None, description="Stage 3 with the optimizer and params on nvme: the step's "
                           "swapped updates run in the background, behind the next forward, "
                           "each group's gather waiting until its master is written (or "
                           "taking it from the step), so the forward's compute overlaps the "
                           "step's disk time. The same numbers; anything else that reads the "
                           "state (a save, an export) waits for the whole step. Default (null): "
                           "on wherever it applies; false: the step before the forward.")
