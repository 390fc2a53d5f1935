"""The MoE layer: top-k router, capacity or dropless dispatch over the EP group, aux losses.

Semantics are docs/model.md; the JAX counterpart is ``reference/moe.py``.
Legend: T tokens on this rank, D model dim, E experts (global), k top-k, L local experts,
N rows received by this rank's experts, P EP size.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moezero.plan import rules


@dataclass(frozen=True)
class ExpertTag:
    """Attached to every expert parameter as ``param.moe``: where it belongs for grouping."""

    group_name: str
    ep_size: int
    expert: int


def expert_tag(param: torch.Tensor) -> ExpertTag | None:
    """The :class:`ExpertTag` of an expert parameter, ``None`` for a dense one."""
    return getattr(param, "moe", None)


class SwiGLU(nn.Module):
    """The default expert: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_ND)) * self.w3(x_ND))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with unequal splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back_out, back_in = ctx.splits
        return _AllToAll.apply(grad, back_out, back_in, ctx.group), None, None, None


def route(logits_TE: torch.Tensor, top_k: int):
    """Softmax router: returns (probs_TE, gates_Tk renormalised, experts_Tk)."""
    probs_TE = logits_TE.softmax(dim=-1)
    sorted_TE, order_TE = probs_TE.sort(dim=-1, descending=True, stable=True)  # ties: low index
    top_Tk, experts_Tk = sorted_TE[:, :top_k], order_TE[:, :top_k]
    gates_Tk = top_Tk / top_Tk.sum(dim=-1, keepdim=True)
    return probs_TE, gates_Tk, experts_Tk


def aux_losses(logits_TE, probs_TE, experts_Tk, num_experts: int):
    """(load-balancing aux, router z-loss), both per docs/model.md; counts before drops."""
    num_tokens, top_k = experts_Tk.shape
    counts_E = torch.bincount(experts_Tk.reshape(-1), minlength=num_experts)
    frac_E = counts_E.to(probs_TE.dtype) / (num_tokens * top_k)
    aux = num_experts * (frac_E * probs_TE.mean(dim=0)).sum()
    z = torch.logsumexp(logits_TE, dim=-1).square().mean()
    return aux, z


def keep_mask(experts_Tk: torch.Tensor, num_experts: int, capacity_factor: float | None):
    """Which assignments survive capacity: choice-major, then token order (docs/model.md)."""
    num_tokens, top_k = experts_Tk.shape
    if capacity_factor is None:
        return torch.ones_like(experts_Tk, dtype=torch.bool)
    capacity = math.ceil(capacity_factor * num_tokens * top_k / num_experts)
    order_A = experts_Tk.t().reshape(-1)  # assignment a = j*T + t
    onehot_AE = F.one_hot(order_A, num_experts)
    position_A = (onehot_AE.cumsum(dim=0) * onehot_AE).sum(dim=-1) - 1
    return (position_A < capacity).reshape(top_k, num_tokens).t()


class MoE(nn.Module):
    """A Mixture-of-Experts layer around any expert module.

    Args:
        dim: model dimension D (router input).
        expert: an ``nn.Module`` mapping [n, D] -> [n, D] (deep-copied per local expert, then
            re-initialised) or a callable ``global_index -> nn.Module``.
        num_experts: E, global.
        top_k: experts per token.
        capacity_factor: ``None`` for dropless, else C = ceil(cf * T * k / E) per expert.
        ep_size: expert-parallel size; this rank holds experts of its EP rank.
        ep_rank: this rank's index in its EP group (``Topology.ep_rank(ep_size)``).
        ep_group: the EP process group (``None`` when ep_size == 1).
        expert_group_name: the moe group name used to build optimizer groups.
        aux_loss_coef, z_loss_coef: weights of the aux and z losses in the returned aux loss.
    """

    def __init__(self, dim: int, expert: nn.Module | Callable[[int], nn.Module], *,
                 num_experts: int, top_k: int = 2, capacity_factor: float | None = None,
                 ep_size: int = 1, ep_rank: int = 0, ep_group=None,
                 expert_group_name: str | None = None,
                 aux_loss_coef: float = 0.01, z_loss_coef: float = 0.001):
        super().__init__()
        problem = rules.ep_size_problem(ep_size, num_experts=num_experts)
        if problem is not None:
            raise ValueError(f"moe.ep_size: {problem}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moe.top_k: {top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.ep_size, self.ep_rank, self.ep_group = ep_size, ep_rank, ep_group
        self.num_local = num_experts // ep_size
        self.group_name = rules.expert_group_name(expert_group_name, ep_size=ep_size)
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router = nn.Linear(dim, num_experts, bias=False)
        self._expert_source = (expert,)  # a tuple: a template module is not a submodule
        self.experts = nn.ModuleDict({str(e): _make_expert(expert, e) for e in self.local_experts})
        for e, module in self.experts.items():
            for p in module.parameters():
                p.moe = ExpertTag(self.group_name, ep_size, int(e))
        self.last_stats: dict[str, torch.Tensor] = {}

    @property
    def local_experts(self) -> range:
        first = self.ep_rank * self.num_local
        return range(first, first + self.num_local)

    def expert_shapes(self, e: int) -> dict[str, tuple[int, ...]]:
        """Parameter shapes of expert ``e`` (global index) by name within the expert: this
        rank's module, the template, or the factory's module built on the meta device (no
        memory), so every rank plans every expert from its own shapes (``zero.groups``).

        Raises ValueError (one line) when the factory cannot build it on the meta device.
        """
        source = self._expert_source[0]
        if str(e) in self.experts:
            module = self.experts[str(e)]
        elif isinstance(source, nn.Module):
            module = source
        else:
            try:
                with torch.device("meta"):
                    module = source(e)
            except Exception as exc:
                raise ValueError(f"expert {e}: cannot be built on the meta device to read its "
                                 f"shapes: {type(exc).__name__}: {exc}") from None
        return {name: tuple(p.shape) for name, p in module.named_parameters()}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output shaped like x, weighted aux loss = aux_coef*aux + z_coef*z)."""
        x_TD = x.reshape(-1, x.shape[-1])
        logits_TE = F.linear(x_TD.float(), self.router.weight.float())
        probs_TE, gates_Tk, experts_Tk = route(logits_TE, self.top_k)
        aux, z = aux_losses(logits_TE, probs_TE, experts_Tk, self.num_experts)
        keep_Tk = keep_mask(experts_Tk, self.num_experts, self.capacity_factor)
        # Kept assignments in drop order (choice-major), then stably sorted by expert.
        token_A = torch.arange(x_TD.shape[0], device=x.device).repeat(self.top_k)
        expert_A, gate_A, kept_A = (t.t().reshape(-1) for t in (experts_Tk, gates_Tk, keep_Tk))
        token_A, expert_A, gate_A = token_A[kept_A], expert_A[kept_A], gate_A[kept_A]
        order = torch.argsort(expert_A, stable=True)
        token_A, expert_A, gate_A = token_A[order], expert_A[order], gate_A[order]
        counts_E = torch.bincount(expert_A, minlength=self.num_experts)
        y_AD = self._run_experts(x_TD[token_A], counts_E)
        out_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x.device)
        out_TD.index_add_(0, token_A, y_AD.float() * gate_A.unsqueeze(-1))
        self.last_stats = {"dropped": (~keep_Tk).sum().detach(), "tokens_per_expert": counts_E}
        aux_loss = self.aux_loss_coef * aux + self.z_loss_coef * z
        return out_TD.to(x.dtype).reshape(x.shape), aux_loss

    def _run_experts(self, rows_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Send rows (sorted by expert) to their owners, run local experts, bring results back."""
        if self.ep_size == 1:
            return self._apply_local(rows_AD, counts_E.tolist())
        counts_PL = counts_E.reshape(self.ep_size, self.num_local)
        recv_PL = torch.empty_like(counts_PL)
        dist.all_to_all_single(recv_PL, counts_PL.contiguous(), group=self.ep_group)
        send_splits, recv_splits = counts_PL.sum(1).tolist(), recv_PL.sum(1).tolist()
        recv_ND = _AllToAll.apply(rows_AD, recv_splits, send_splits, self.ep_group)
        # Received rows are grouped by source rank, then local expert: regroup by expert.
        expert_N = torch.repeat_interleave(
            torch.arange(self.num_local, device=rows_AD.device).repeat(self.ep_size),
            recv_PL.reshape(-1))
        by_expert = torch.argsort(expert_N, stable=True)
        y_ND = torch.empty_like(recv_ND)
        y_ND = y_ND.index_copy(0, by_expert,
                               self._apply_local(recv_ND[by_expert], recv_PL.sum(0).tolist()))
        return _AllToAll.apply(y_ND, send_splits, recv_splits, self.ep_group)

    def _apply_local(self, rows_ND: torch.Tensor, counts_L: list[int]) -> torch.Tensor:
        """Run each local expert on its contiguous block of rows (empty blocks included)."""
        chunks = rows_ND.split(counts_L)
        outs = [self.experts[str(e)](chunk) for e, chunk in zip(self.local_experts, chunks, strict=True)]
        return torch.cat(outs, dim=0)


def _make_expert(expert, index: int) -> nn.Module:
    if not isinstance(expert, nn.Module):
        return expert(index)
    module = copy.deepcopy(expert)
    for sub in module.modules():
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    return module
