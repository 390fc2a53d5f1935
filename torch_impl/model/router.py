"""The MoE router: scores, the top-k choice and the gates, and the aux-loss-free expert bias.

Variants (docs/model.md, "Router"): softmax or sigmoid scores; the top-k gates renormalised to
sum 1 or not; an expert bias (DeepSeek-V3's aux-loss-free balancing) added to the scores for
the choice only, updated after each optimizer step from the global expert loads, outside the
optimizer; DeepSeek-V3's group-limited choice (``limit_to_groups``) and routed scaling
factor. The JAX counterpart is ``reference/moe.py: route`` and ``update_expert_bias``.
Legend: T tokens, D model dim, E experts, k top-k, L MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moezero.model.recompute import recomputing
from moezero.plan import rules

SCORINGS = ("softmax", "sigmoid", "topk_softmax")


@dataclass(frozen=True)
class RouterOptions:
    """How a router scores and gates (``moe.router_scoring``, ``moe.renormalize``,
    ``moe.expert_bias``, ``moe.bias_update_rate``, ``moe.router_bias``: ``linear_bias``)."""

    scoring: str = "softmax"
    renormalize: bool = True
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    linear_bias: bool = False
    # DeepSeek-V3 / GLM-4.5 routing (``moe.n_group``, ``moe.topk_group``,
    # ``moe.routed_scaling_factor``): the choice limited to the best groups, gates scaled.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"moe.router_scoring: {self.scoring!r} is not one of {SCORINGS}")


def route(logits_TE: torch.Tensor, top_k: int, *, scoring: str = "softmax",
          renormalize: bool = True, bias_E: torch.Tensor | None = None,
          groups: tuple[int, int] = (1, 1), scale: float = 1.0):
    """Scores, top-k and gates of fp32 router logits.

    Returns:
        ``(probs_TE, gates_Tk, experts_Tk)``: the scores normalised to sum 1 per token (the aux
        loss's P; softmax: the scores themselves), the gates (the chosen experts' scores,
        renormalised or not, times ``scale``) and the chosen experts, best first. The choice
        ranks ``scores + bias_E`` (ties: lower index first) among the experts of the best
        groups (``groups`` = (n_group, topk_group): ``limit_to_groups``); the gates never
        include the bias. ``topk_softmax`` (gpt-oss): the choice ranks the logits (plus
        ``bias_E``), the gates are a softmax over the k chosen logits, and the scores are the
        softmax over all.
    """
    if scoring == "topk_softmax":
        choice_TE = logits_TE if bias_E is None else logits_TE + bias_E
        experts_Tk = choice_TE.sort(dim=-1, descending=True, stable=True)[1][:, :top_k]
        return logits_TE.softmax(dim=-1), logits_TE.gather(1, experts_Tk).softmax(-1), experts_Tk
    scores_TE = logits_TE.softmax(dim=-1) if scoring == "softmax" else logits_TE.sigmoid()
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E
    if groups[0] > 1:
        choice_TE = limit_to_groups(choice_TE, *groups)
    experts_Tk = choice_TE.sort(dim=-1, descending=True, stable=True)[1][:, :top_k]
    top_Tk = scores_TE.gather(1, experts_Tk)
    gates_Tk = top_Tk / top_Tk.sum(dim=-1, keepdim=True) if renormalize else top_Tk
    if scale != 1.0:
        gates_Tk = gates_Tk * scale
    probs_TE = scores_TE if scoring == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True)
    return probs_TE, gates_Tk, experts_Tk


def limit_to_groups(choice_TE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited choice (transformers' noaux_tc): the E experts split into
    ``n_group`` consecutive groups, each scored by the sum of its two best choice scores; the
    experts outside the ``topk_group`` best groups (ties: lower group first) get -inf."""
    num_tokens, num_experts = choice_TE.shape
    grouped_TGe = choice_TE.view(num_tokens, n_group, num_experts // n_group)
    group_TG = grouped_TGe.topk(2, dim=-1)[0].sum(dim=-1)
    best_Tg = group_TG.sort(dim=-1, descending=True, stable=True)[1][:, :topk_group]
    keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, best_Tg, True)
    return grouped_TGe.masked_fill(~keep_TG[..., None], float("-inf")).view_as(choice_TE)


def expert_counts(experts_Tk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert (int64) with a static shape: no host sync, unlike ``bincount``."""
    flat = experts_Tk.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts_E.scatter_add_(0, flat, torch.ones_like(flat))


class Router(nn.Linear):
    """Router weight [E, D] (FQN ``router.weight``, an ``nn.Linear``, with ``router.bias`` [E]
    only with ``options.linear_bias``) and, with
    ``options.expert_bias``, the fp32 buffer ``router.expert_bias`` [E] (checkpointed, never
    optimized) with the expert loads counted since the last update (not saved; a forward recomputed by
    activation checkpointing is not counted again).

    ``forward(x_TD)`` returns ``(logits_TE, probs_TE, gates_Tk, experts_Tk)``; the logits are
    computed in fp32 (x and W upcast).
    """

    def __init__(self, dim: int, num_experts: int, top_k: int,
                 options: RouterOptions = RouterOptions()):
        super().__init__(dim, num_experts, bias=options.linear_bias)
        problem = rules.group_problem(num_experts=num_experts, top_k=top_k,
                                      n_group=options.n_group, topk_group=options.topk_group)
        if problem is not None:
            raise ValueError(f"moe.{problem[0]}: {problem[1]}")
        self.num_experts, self.top_k, self.options = num_experts, top_k, options
        self.register_buffer("expert_bias", torch.empty(num_experts) if options.expert_bias
                             else None)
        if options.expert_bias:
            self.register_buffer("pending_load", torch.empty(num_experts, dtype=torch.int64),
                                 persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The buffers' initial values: no bias, no load counted. Also how a router built on
        the meta device gets them (``moezero.model.materialize``)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self.pending_load.zero_()

    def forward(self, x_TD: torch.Tensor):
        logits_TE = F.linear(x_TD.float(), self.weight.float(),
                             None if self.bias is None else self.bias.float())
        opts = self.options
        probs_TE, gates_Tk, experts_Tk = route(
            logits_TE, self.top_k, scoring=opts.scoring, renormalize=opts.renormalize,
            bias_E=self.expert_bias, groups=(opts.n_group, opts.topk_group),
            scale=opts.routed_scaling_factor)
        # A checkpointed block's recomputation in backward routes the same tokens again.
        if (self.expert_bias is not None and self.training and torch.is_grad_enabled()
                and not recomputing()):
            self.pending_load += expert_counts(experts_Tk, self.num_experts)  # no host sync
        return logits_TE, probs_TE, gates_Tk, experts_Tk

    @torch.no_grad()
    def apply_load(self, load_E: torch.Tensor) -> None:
        """``bias_e += rate · sign(mean load − load_e)``: underloaded experts rise (exact in
        integers: ``sign(Σ load − E · load_e)``)."""
        sign_E = torch.sign(load_E.sum() - self.num_experts * load_E).float()
        self.expert_bias.add_(sign_E * self.options.bias_update_rate)

    def _apply(self, fn, recurse=True):
        """Moves and casts as any module, except the expert bias, which stays fp32 (its
        ±rate steps would round away in bf16)."""
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = bias.to(device=self.expert_bias.device, dtype=torch.float32)
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, top_k={self.top_k}, {self.options}"


def biased_routers(model: nn.Module) -> list[Router]:
    """The routers of ``model`` that carry an expert bias, in module order."""
    return [m for m in model.modules() if isinstance(m, Router) and m.expert_bias is not None]


def update_expert_biases(model: nn.Module, *, distributed: bool, skip: bool = False) -> None:
    """After an optimizer step: sum every biased router's load over all ranks (one all-reduce
    on the world group, so every rank applies the same update) and step its bias; then start
    counting afresh. ``skip`` (a step skipped on fp16 overflow, the same on every rank) drops
    the loads without an update. Collective when ``distributed`` and a router has a bias."""
    routers = biased_routers(model)
    if not routers:
        return
    if not skip:
        load_LE = torch.stack([r.pending_load for r in routers])
        if distributed:
            dist.all_reduce(load_LE)
        for router, load_E in zip(routers, load_LE, strict=True):
            router.apply_load(load_E)
    for router in routers:
        router.pending_load.zero_()
