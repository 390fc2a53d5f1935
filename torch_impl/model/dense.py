"""The dense MLP kind: one SwiGLU every token goes through, at ``layers.N.mlp`` in place of the
MoE layer, as the first ``first_k_dense_replace`` layers of DeepSeek-V3 (``model.first_k_dense``,
width ``model.dense_ffn_dim``). Its parameters are dense: every rank holds them and they are
averaged over all W ranks like attention, in the plan's dense groups (docs/grouping.md); the
layer adds no aux loss. The JAX counterpart is ``reference/dense.py``; semantics are
docs/model.md ("Dense MLP layers").
Legend: B batch, S sequence, D model dim, F hidden dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moezero.model.kind import MlpKind, Placement


class DenseMLP(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: ``w1``, ``w3`` [F, D], ``w2`` [D, F], no biases."""

    lora_owner, lora_projections = "mlp", ("w1", "w2", "w3")  # moezero.model.lora

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BSD)) * self.w3(x_BSD))


def _modules(args, at: Placement) -> dict[str, nn.Module]:
    return {"mlp": DenseMLP(args.dim, args.dense_hidden)}


def _apply(block: nn.Module, x_BSD: torch.Tensor) -> tuple[torch.Tensor, None]:
    return block.mlp(x_BSD), None


DENSE = MlpKind("dense", _modules, _apply, hf_names={
    "mlp.w1.weight": "mlp.gate_proj.weight", "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight"})
"""The dense SwiGLU MLP (DeepSeek-style Hugging Face names ``mlp.{gate,up,down}_proj``)."""
