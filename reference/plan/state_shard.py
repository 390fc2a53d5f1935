"""The record the optimizer and the checkpoint exchange: one DP rank's state of one group.

The optimizer (``moezero.zero``: ``shards()`` to save, ``load_targets()`` to fill) produces
``StateShard``s and the checkpoint (``moezero.checkpoint.save`` / ``load``) consumes them,
neither importing the other: the record lives here, below both (docs/design.md, "Who imports
whom"). It holds the arrays it is given and never looks inside them, so it stays pure Python:
on the torch side they are ``torch.Tensor``s; the JAX reference writes numpy arrays straight
through ``moezero.plan.store``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moezero.plan.partition import Partition


@dataclass(frozen=True)
class StateShard:
    """One DP rank's fp32 state of one group, as checkpoints see it.

    Attributes:
        partition: The group's partition (``plan_partitions``).
        dp_rank: Whose shard it is, within the group's DP ranks.
        tensors: State name (``moezero.plan.rules.STATES``) -> an fp32 array of the shard's
            real elements, or of the padded shard (torch: a ``torch.Tensor``); None when
            ``files`` holds the state.
        files: NVMe-offloaded: state name -> the swap file holding the padded shard from
            byte 0; None when ``tensors`` holds it.
    """

    partition: Partition
    dp_rank: int
    tensors: Mapping[str, Any] | None = None
    files: Mapping[str, Path] | None = None
