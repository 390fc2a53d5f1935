"""The MoE MLP kind: the routed SwiGLU experts (``moezero.model.moe``, at ``layers.N.moe``)
plus, with ``moe.shared_ffn_dim``, the always-on shared expert (``moezero.model.shared``, at
``layers.N.shared``), summed; its weighted aux loss is the layer's.

The routed experts' Hugging Face names are the family's (``Family.expert_names``, per-expert
or fused: ``moezero.checkpoint.hf.names``); the router and the shared expert are named here.
The JAX counterpart is ``reference/model.py: moe_mlp``; semantics are docs/model.md
("MoE layer", "Shared expert").
Legend: B batch, S sequence, D model dim.
"""

from __future__ import annotations

import torch
from torch import nn

from moezero.model.experts import SwiGLU
from moezero.model.kind import MlpKind, Placement
from moezero.model.moe import MoE, SameExperts
from moezero.model.shared import SharedExpert


def _modules(args, at: Placement) -> dict[str, nn.Module]:
    modules: dict[str, nn.Module] = {"moe": MoE(
        args.dim, SameExperts(lambda: SwiGLU(args.dim, args.ffn_dim, bias=args.expert_mlp_bias,
                                             limit=args.swiglu_limit, alpha=args.swiglu_alpha)),
        num_experts=args.num_experts,
        top_k=args.top_k, capacity_factor=args.capacity_factor, ep_size=args.ep_size,
        ep_rank=at.ep_rank, ep_group=at.ep_group, expert_group_name=args.expert_group_name,
        aux_loss_coef=args.aux_loss_coef, z_loss_coef=args.z_loss_coef, router=args.router)}
    if args.shared_ffn_dim:
        modules["shared"] = SharedExpert(args.dim, args.shared_ffn_dim, args.shared_gate)
    return modules


def _apply(block: nn.Module, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y, aux = block.moe(x_BSD)
    shared = getattr(block, "shared", None)
    return (y if shared is None else y + shared(x_BSD)), aux


MOE = MlpKind("moe", _modules, _apply, hf_names={
    "moe.router.weight": "{moe_block}.gate.weight",
    "moe.router.bias": "{moe_block}.gate.bias",
    "moe.router.expert_bias": "{moe_block}.gate.e_score_correction_bias",
    "shared.w1.weight": "mlp.{shared}.gate_proj.weight",
    "shared.w3.weight": "mlp.{shared}.up_proj.weight",
    "shared.w2.weight": "mlp.{shared}.down_proj.weight",
    "shared.gate.weight": "mlp.shared_expert_gate.weight"})
"""Routed experts and the optional shared expert (``{shared}``: the family's name of it,
``shared_expert`` for Qwen2-MoE, ``shared_experts`` for DeepSeek-V3 and GLM-4.5)."""
