"""Which keys a query reads (causal, within its document, within a sliding window) and
attention with learned per-head sinks (gpt-oss), on ``scaled_dot_product_attention``.

A sink is a logit ``s_h`` per query head that joins every query's softmax and is then
dropped: ``p_j = exp(a_j) / (Σ_i exp(a_i) + exp(s_h))``. It is computed as one more key that
every query may read, with a zero value: q and k get one more dim, ``s_h · sqrt(K)`` on the
queries of head h and 1 on the extra key (0 on the real keys), and the scale stays
``1/sqrt(K)``, so the extra key's logit is ``s_h`` and the real logits are unchanged (works
with grouped-query heads, masks and autograd as they are). Semantics: docs/model.md
("gpt-oss's options"); the JAX counterpart is ``reference/model.py: attention`` (scores, the sink
column, softmax, drop). Legend: B batch, S sequence, H query heads, G key/value heads,
K head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moezero.model.packing import DocumentMask


def allowed_keys(seq: int, device: torch.device, docs: DocumentMask | None,
                 window: int | None) -> torch.Tensor | None:
    """bool [B or 1, 1, S, S]: causal (within each document of ``docs``) and, with
    ``window``, ``i - j < window`` (transformers' sliding window); None when plain causal."""
    if docs is None and window is None:
        return None
    allowed = docs.allowed_B1SS if docs is not None else \
        torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None]
    if window is not None:
        index_S = torch.arange(seq, device=device)
        allowed = allowed & ((index_S[:, None] - index_S[None, :]) < window)
    return allowed


def sink_attention(q_BHSK: torch.Tensor, k_BGSK: torch.Tensor, v_BGSK: torch.Tensor,
                   sinks_H: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention whose every row also holds the head's sink logit (then dropped);
    ``allowed`` as ``allowed_keys`` (None: causal). Returns [B, H, S, K]."""
    b, h, s, k = q_BHSK.shape
    g = k_BGSK.shape[1]
    scale = k ** -0.5
    sink_q = (sinks_H.to(q_BHSK.dtype) / scale)[None, :, None, None].expand(b, h, s, 1)
    q = torch.cat([q_BHSK, sink_q], dim=-1)
    extra_k = torch.zeros(b, g, 1, k + 1, dtype=k_BGSK.dtype, device=k_BGSK.device)
    extra_k[..., -1] = 1
    keys = torch.cat([F.pad(k_BGSK, (0, 1)), extra_k], dim=2)
    values = F.pad(v_BGSK, (0, 0, 0, 1))
    if allowed is None:
        allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()[None, None]
    allowed = F.pad(allowed, (0, 1), value=True)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale,
                                          enable_gqa=g != h)
