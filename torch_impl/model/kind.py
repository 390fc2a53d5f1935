"""What a layer kind is: the contract between a decoder block and the modules it composes.

A block (``moezero.model.decoder.Block``) is an attention kind and an MLP kind, each chosen per
layer from the config by ``moezero.model.kinds``. A kind builds the block's own submodules,
named by the attribute the block registers them under, so a parameter's FQN is
``layers.N.<attribute>.<name within the module>`` (``layers.0.attn.wq.weight``,
``layers.3.moe.router.weight``, ``layers.0.mlp.w1.weight``), and says how they run. Beside it
the kind declares its Hugging Face names: plain data that ``moezero.checkpoint.hf.names``
reads, so the model imports nothing of the checkpoint. How to add one: docs/model.md,
"Adding a layer kind".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from moezero.model.args import ModelArgs
    from moezero.model.packing import DocumentMask


@dataclass(frozen=True)
class Placement:
    """Where a block's modules live among the ranks: its layer index and this rank's EP rank
    and group (``Decoder``'s ``ep_rank`` / ``ep_group``); a kind without experts ignores it."""

    layer: int
    ep_rank: int = 0
    ep_group: object = None


Build = Callable[["ModelArgs", Placement], dict[str, nn.Module]]
"""``(args, placement) -> {block attribute: module}``, in registration (parameter) order."""


@dataclass(frozen=True)
class AttentionKind:
    """A token-mixing kind: ``apply(block, x_BSD, docs) -> y_BSD``.

    Attributes:
        name: the kind's name in the config.
        build: the modules it adds to a block (``Build``).
        apply: its forward, reading its modules from the block by attribute.
        hf_names: ``{moezero FQN within a layer: Hugging Face key within a layer}``.
    """

    name: str
    build: Build
    apply: Callable[[nn.Module, torch.Tensor, DocumentMask | None], torch.Tensor]
    hf_names: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MlpKind:
    """A per-token kind after the attention: ``apply(block, x_BSD) -> (y_BSD, aux)``, ``aux``
    the layer's weighted auxiliary loss or ``None`` for a kind without one (the decoder's
    total skips it). Attributes as ``AttentionKind``'s; ``hf_names`` values may hold
    ``{moe_block}``, the family's name of its MoE block (``Family.moe_block``), and
    ``{shared}``, its shared expert's (``Family.shared_block``)."""

    name: str
    build: Build
    apply: Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
    hf_names: Mapping[str, str] = field(default_factory=dict)
