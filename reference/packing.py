"""Document-masked packing in the reference: where each packed document starts, its tokens'
positions and the attention they may take. Torch counterpart: ``torch_impl/model/packing.py``
(``document_mask``); the model uses it in ``reference/model.py: attention``.

Shape legend: B batch, S sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class DocumentLayout(NamedTuple):
    """A packed row's documents: each position's offset in its document (0 at its first token
    in the row) and which keys each query may read (same document, not later)."""

    positions_BS: jax.Array
    allowed_BSS: jax.Array


def document_layout(documents_BS: jax.Array) -> DocumentLayout:
    """The layout of rows labelled by document: a new document wherever the label changes.
    Torch counterpart: ``torch_impl/model/packing.py: document_mask``."""
    s = documents_BS.shape[1]
    starts_BS = jnp.concatenate([jnp.ones_like(documents_BS[:, :1], bool),
                                 documents_BS[:, 1:] != documents_BS[:, :-1]], axis=1)
    index_S = jnp.arange(s)
    first_BS = jax.lax.cummax(jnp.where(starts_BS, index_S, 0), axis=1)
    segment_BS = jnp.cumsum(starts_BS, axis=1)
    same_BSS = segment_BS[:, :, None] == segment_BS[:, None, :]
    return DocumentLayout(index_S - first_BS, same_BSS & jnp.tril(jnp.ones((s, s), bool)))
