"""The LM head, and its loss computed a chunk of tokens at a time (``model.loss_chunk_tokens``).

A decoder's logits are tokens × vocab: at 1,024 tokens and Qwen3's 151,936-entry vocabulary,
311 MB in bf16, and the fp32 cross-entropy keeps two more fp32 copies (the upcast and its
log-softmax, 622 MB each) until backward, which makes as many again: the largest transient
of a big-vocabulary fine-tune. ``Head`` called with targets returns the summed fp32
cross-entropy instead, computed ``chunk`` tokens at a time by ``ChunkedCrossEntropy``: each
chunk's logits are made, reduced to their loss and dropped in the forward, and made again in
the backward (one more matmul of the head per step), so only one chunk's logits live at once.

The head's weight is used once by the autograd graph (one gradient accumulation, as the
stage-3 gatherer expects), and the head stays one module call, so a stage-3 gather unit gathers
it once per pass. Each chunk's loss and gradients are torch's own cross-entropy on that
chunk's logits (computed like ``nn.Linear``'s, in the compute dtype, then upcast); the sum over
chunks is the unchunked sum up to the order of the fp32 additions and the matmul's blocking.
Reference counterpart: none (the reference computes whole logits; the two paths are compared
in tests/torch_impl/test_head.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moezero.model.packing import IGNORE


class Head(nn.Linear):
    """``nn.Linear`` (logits), or with ``targets`` the summed fp32 cross-entropy of its
    logits, ``chunk`` rows at a time (``ChunkedCrossEntropy``)."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                chunk: int | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return ChunkedCrossEntropy.apply(x.flatten(0, -2), self.weight, targets.flatten(),
                                         chunk or x.shape[-2])


class ChunkedCrossEntropy(torch.autograd.Function):
    """Σ over rows of the fp32 cross-entropy of ``x W^T`` against ``targets`` (``IGNORE``:
    no loss, no gradient), ``chunk`` rows at a time; nothing of the logits is saved."""

    @staticmethod
    def forward(ctx, x_NI, w_VI, targets_N, chunk: int):
        ctx.save_for_backward(x_NI, w_VI, targets_N)
        ctx.chunk = chunk
        total = torch.zeros((), dtype=torch.float32, device=x_NI.device)
        for lo in range(0, x_NI.shape[0], chunk):
            total += _chunk_loss(x_NI[lo:lo + chunk], w_VI, targets_N[lo:lo + chunk])
        return total

    @staticmethod
    def backward(ctx, grad):
        x_NI, w_VI, targets_N = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[:2]
        dx_NI = torch.empty_like(x_NI) if want_x else None
        dw_VI = torch.zeros_like(w_VI, dtype=torch.float32) if want_w else None
        for lo in range(0, x_NI.shape[0], ctx.chunk):
            with torch.enable_grad():
                x = x_NI[lo:lo + ctx.chunk].detach().requires_grad_(want_x)
                w = w_VI.detach().requires_grad_(want_w)
                loss = _chunk_loss(x, w, targets_N[lo:lo + ctx.chunk])
                wanted = [t for t, want in ((x, want_x), (w, want_w)) if want]
                grads = iter(torch.autograd.grad(loss, wanted, grad))
            if want_x:
                dx_NI[lo:lo + ctx.chunk] = next(grads)
            if want_w:
                dw_VI += next(grads)
        return dx_NI, None if dw_VI is None else dw_VI.to(w_VI.dtype), None, None


def _chunk_loss(x_NI: torch.Tensor, w_VI: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(x_NI, w_VI).float(), targets_N, ignore_index=IGNORE,
                           reduction="sum")
