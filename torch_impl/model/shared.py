"""Shared experts: an always-on SwiGLU beside the routed experts, optionally gated per token.

Qwen2-MoE's ``shared_expert`` with its ``shared_expert_gate`` (``y = sigmoid(x·g) ·
w2(silu(w1 x) * w3 x)``), and DeepSeek's shared experts (n of them equal one SwiGLU n times as
wide, ungated). Its parameters are dense: every rank holds them and they are averaged over all
W ranks like attention (docs/grouping.md). The JAX counterpart is ``reference/model.py:
shared_expert``; semantics are docs/model.md ("Shared expert").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SharedExpert(nn.Module):
    """``w1``, ``w3`` [F, D], ``w2`` [D, F] and, with ``gate``, ``gate.weight`` [1, D]."""

    lora_owner, lora_projections = "shared", ("w1", "w2", "w3")  # moezero.model.lora

    def __init__(self, dim: int, hidden: int, gate: bool):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.gate = nn.Linear(dim, 1, bias=False) if gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return y if self.gate is None else torch.sigmoid(self.gate(x)) * y
