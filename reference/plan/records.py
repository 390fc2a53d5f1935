"""The manifest's engine and topology records, written by every saver (pure Python).

A checkpoint's ``manifest.json`` carries ``topology`` (how the saving run was laid out) and
``state.engine`` (the counters a resume needs). Both sides build them from these frozen
records, so the torch engine (``moezero.engine.Engine``), the JAX reference
(``moezero.reference.checkpoint.save_train_state``) and the readers agree on the keys by
construction. The JSON forms are the on-disk format (docs/checkpoint.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TopologyRecord:
    """How the saving run was laid out (informational: any layout loads any checkpoint).

    Attributes:
        world_size: W at save.
        ep_sizes: The expert-parallel sizes of the MoE layers.
        zero_stage: The ZeRO stage (None: a writer without one, e.g. the reference).
        dtype: The compute dtype (``float32``, ``bfloat16``, ...).
        max_group_size, split_groups_by_expert, split_dense_by_layer: The grouping plan's
            options (the last written only when set).
        offload_optimizer: Where the optimizer state lived (torch: ``none|cpu|nvme``).
        writer: Who wrote a checkpoint that no training engine saved (``reference``).
    """

    world_size: int
    ep_sizes: tuple[int, ...]
    zero_stage: int | None
    dtype: str
    max_group_size: int | None
    split_groups_by_expert: bool
    offload_optimizer: str | None = None
    writer: str | None = None
    split_dense_by_layer: bool = False

    def to_json(self) -> dict:
        out = {"world_size": self.world_size, "ep_sizes": list(self.ep_sizes),
               "zero_stage": self.zero_stage, "dtype": self.dtype}
        if self.offload_optimizer is not None:
            out["offload_optimizer"] = self.offload_optimizer
        out.update(max_group_size=self.max_group_size,
                   split_groups_by_expert=self.split_groups_by_expert)
        if self.split_dense_by_layer:
            out["split_dense_by_layer"] = True
        if self.writer is not None:
            out["writer"] = self.writer
        return out


@dataclass(frozen=True)
class EngineRecord:
    """The counters a resume needs (``manifest.state["engine"]``).

    Attributes:
        step_count: Optimizer steps taken (fp16-skipped steps excluded): Adam's bias
            correction and the lr schedule (``lr_step``) read it.
        global_steps: Optimizer step calls, skipped ones included (checkpoint names).
        lr: The learning rate of the next step (informational).
        loss_scaler: The fp16 loss scaler's state (torch; None where there is none).
    """

    step_count: int
    global_steps: int
    lr: float | None = None
    loss_scaler: dict | None = None

    def to_json(self) -> dict:
        out = {"step_count": self.step_count, "global_steps": self.global_steps,
               "lr_step": self.step_count, "lr": self.lr}
        if self.loss_scaler is not None:
            out["loss_scaler"] = dict(self.loss_scaler)
        return out

    @classmethod
    def from_json(cls, obj: dict | None) -> EngineRecord:
        """The record of a manifest's ``state.engine`` (absent: a fresh start at step 0)."""
        obj = obj or {}
        steps = int(obj.get("step_count", 0))
        return cls(steps, int(obj.get("global_steps", steps)), obj.get("lr"),
                   obj.get("loss_scaler"))
