"""``optimizer.scheduler``: DeepSpeed's lr schedules by their own names and parameters (its
``scheduler`` block), so a run imported from DeepSpeed (``moezero import-deepspeed``) continues
on its schedule; the lr math is ``moezero.zero.lr_schedule``. Unset, moezero's own warmup +
cosine (``optimizer.warmup_steps``, ``min_lr_ratio``) drives the lr."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moezero.config.errors import FieldError
from moezero.config.section import Section


class LRScheduleConfig(Section):
    """One of DeepSpeed's schedules; its peak is ``optimizer.lr`` (DeepSpeed's
    ``warmup_max_lr``, or the optimizer's lr for WarmupCosineLR)."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] = Field(
        description="WarmupLR: warm up, then constant; WarmupDecayLR: then linear decay to 0 "
                    "at total_num_steps; WarmupCosineLR: then cosine to cos_min_ratio.")
    warmup_num_steps: int = Field(1000, ge=1, description="Warmup steps (at least 2 count).")
    warmup_type: Literal["log", "linear"] = Field(
        "log", description="Warmup curve: log(i + 1) / log(warmup_num_steps), or i / "
                           "warmup_num_steps, at DeepSpeed's iteration i.")
    warmup_min_lr: float = Field(0.0, ge=0, description="WarmupLR/WarmupDecayLR: the lr the "
                                                        "warmup starts from.")
    total_num_steps: int | None = Field(
        None, ge=1, description="WarmupDecayLR/WarmupCosineLR: the step the decay ends at.")
    warmup_min_ratio: float = Field(0.0, ge=0, le=1, description="WarmupCosineLR: the warmup "
                                                                  "starts at lr times this.")
    cos_min_ratio: float = Field(1e-4, ge=0, le=1, description="WarmupCosineLR: the cosine "
                                                               "ends at lr times this.")

    @model_validator(mode="after")
    def _total(self) -> LRScheduleConfig:
        if self.type != "WarmupLR" and self.total_num_steps is None:
            raise FieldError("total_num_steps", f"{self.type} needs total_num_steps")
        return self
