"""Packed sequences: document masks for attention and loss masks for the cross-entropy.

A packed row holds several documents back to back. With a document mask (``data.document_mask``)
each token attends only to the earlier tokens of its own document and its rotary position
counts from the document's first token in the row, so a packed row computes what each
document computes alone. The mask is a block-diagonal causal boolean [B, 1, S, S] given to
``F.scaled_dot_product_attention`` (docs/model.md, "Document masks", for its cost). A loss
mask keeps the targets to train (``loss_mask_BS``, True = trained); the mean is over trained
tokens with a divisor the caller gives (the engine's global count, docs/data.md).

The JAX counterparts are ``reference/packing.py: document_layout`` and ``reference/model.py: cross_entropy``.
Legend: B batch, S sequence, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

IGNORE = -100  # F.cross_entropy's ignore_index: a masked target


@dataclass(frozen=True)
class DocumentMask:
    """Where each position sits in its document (``positions_BS``, int64, 0 at each document's
    first token in the row) and which keys each query may read (``allowed_B1SS``, bool)."""

    positions_BS: torch.Tensor
    allowed_B1SS: torch.Tensor


def document_mask(documents_BS: torch.Tensor) -> DocumentMask:
    """The mask of rows labelled by document: a new document starts wherever the label
    changes (labels need not be unique across a row's non-adjacent runs)."""
    b, s = documents_BS.shape
    starts_BS = torch.ones_like(documents_BS, dtype=torch.bool)
    starts_BS[:, 1:] = documents_BS[:, 1:] != documents_BS[:, :-1]
    index_S = torch.arange(s, device=documents_BS.device)
    first_BS = torch.where(starts_BS, index_S, 0).cummax(dim=1).values
    segment_BS = starts_BS.long().cumsum(dim=1)
    same_BSS = segment_BS[:, :, None] == segment_BS[:, None, :]
    causal_SS = torch.ones(s, s, dtype=torch.bool, device=documents_BS.device).tril()
    return DocumentMask(index_S - first_BS, (same_BSS & causal_SS)[:, None])


def masked_cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor,
                         loss_mask_BS: torch.Tensor, divisor) -> torch.Tensor:
    """Σ over trained targets of the fp32 cross-entropy, divided by ``divisor`` (None: the
    number of trained targets here, at least 1). Masked targets are ignored, so they take
    no part in the loss or its gradient."""
    targets_BS = torch.where(loss_mask_BS, targets_BS, IGNORE)
    total = F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten(),
                            ignore_index=IGNORE, reduction="sum")
    if divisor is None:
        divisor = loss_mask_BS.sum().clamp(min=1)
    return total / divisor


@dataclass(frozen=True)
class Batch:
    """One micro-batch on the torch side: ``tokens_BS1`` int64 [B, S+1], and optionally the
    targets' ``loss_mask_BS`` (bool, True = trained) and the inputs' ``documents_BS``."""

    tokens_BS1: torch.Tensor
    loss_mask_BS: torch.Tensor | None = None
    documents_BS: torch.Tensor | None = None

    @classmethod
    def of(cls, batch) -> Batch:
        """A ``Batch`` of a token tensor or array, a ``Batch``, or a triple of numpy arrays
        (tokens, loss mask or None, documents or None: the data package's ``MicroBatch``)."""
        if isinstance(batch, Batch):
            return batch
        if isinstance(batch, (torch.Tensor, np.ndarray)):
            return cls(torch.as_tensor(batch))
        tokens, mask, docs = batch
        as_tensor = lambda a: None if a is None else torch.from_numpy(a)
        return cls(torch.from_numpy(tokens), as_tensor(mask), as_tensor(docs))

    @property
    def num_seen(self) -> int:
        """Targets in the batch."""
        return self.tokens_BS1[:, 1:].numel()

    @property
    def num_trained(self) -> int:
        """Targets that count in the loss (a host sync when the mask is on a device)."""
        return self.num_seen if self.loss_mask_BS is None else int(self.loss_mask_BS.sum())

    def to(self, device: torch.device) -> Batch:
        return self.apply(lambda t: t.to(device))

    def apply(self, move) -> Batch:
        """Each tensor through ``move`` (e.g. the engine's pinned, non-blocking device copy)."""
        each = lambda t: None if t is None else move(t)
        return Batch(each(self.tokens_BS1), each(self.loss_mask_BS), each(self.documents_BS))
