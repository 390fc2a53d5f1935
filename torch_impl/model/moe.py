"""The MoE layer: top-k router and aux losses, then dispatch to the experts and combine.

The router (``route``, ``aux_losses``) only produces (experts_Tk, gates_Tk); ``MoE.dispatch``
takes them from there: the permutation plan and the EP exchange are ``moezero.model.dispatch``,
the grouped SwiGLU experts ``moezero.model.experts``. Semantics are docs/model.md; the JAX
counterpart is ``reference/moe.py``.
Legend: T tokens on this rank, D model dim, E experts (global), k top-k, L local experts,
N rows received by this rank's experts, P EP size.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moezero.model.dispatch import (
    DispatchPlan,
    by_local_expert,
    capacity,
    combine,
    exchange_sizes,
    gather_tokens,
    permute_rows,
    plan_dispatch,
    send,
    send_back,
)
from moezero.model.experts import SwiGLU, grouped_swiglu, has_grouped_kernel, is_builtin
from moezero.model.meta import on_meta
from moezero.model.router import Router, RouterOptions, expert_counts, route
from moezero.plan import rules

__all__ = ["MoE", "SwiGLU", "aux_losses", "expert_counts", "expert_tag", "keep_mask", "route"]


@dataclass(frozen=True)
class ExpertTag:
    """Attached to every expert parameter as ``param.moe``: where it belongs for grouping."""

    group_name: str
    ep_size: int
    expert: int


def expert_tag(param: torch.Tensor) -> ExpertTag | None:
    """The :class:`ExpertTag` of an expert parameter, ``None`` for a dense one."""
    return getattr(param, "moe", None)


def aux_losses(logits_TE, probs_TE, experts_Tk, num_experts: int):
    """(load-balancing aux, router z-loss), both per docs/model.md; counts before drops."""
    num_tokens, top_k = experts_Tk.shape
    counts_E = expert_counts(experts_Tk, num_experts)
    frac_E = counts_E.to(probs_TE.dtype) / (num_tokens * top_k)
    aux = num_experts * (frac_E * probs_TE.mean(dim=0)).sum()
    z = torch.logsumexp(logits_TE, dim=-1).square().mean()
    return aux, z


def keep_mask(experts_Tk: torch.Tensor, num_experts: int, capacity_factor: float | None):
    """Which assignments survive capacity: choice-major, then token order (docs/model.md)."""
    num_tokens, top_k = experts_Tk.shape
    cap = capacity(num_tokens, num_experts, top_k, capacity_factor)
    return plan_dispatch(experts_Tk, num_experts, cap).keep_A.view(top_k, num_tokens).t()


class SameExperts:
    """An expert factory ``global_index -> nn.Module`` whose experts are all built alike (the
    index unused): one expert's shapes are every expert's, so ``MoE.expert_shapes`` builds one
    on the meta device per layer (``shapes``), not one per expert held by another EP rank."""

    def __init__(self, build: Callable[[], nn.Module]):
        self.build = build

    def __call__(self, index: int) -> nn.Module:
        return self.build()

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter shapes of any expert, by name within it (built once, on meta)."""
        with on_meta():
            module = self.build()
        return {name: tuple(p.shape) for name, p in module.named_parameters()}


class MoE(nn.Module):
    """A Mixture-of-Experts layer around any expert module.

    Args:
        dim: model dimension D (router input).
        expert: an ``nn.Module`` mapping [n, D] -> [n, D] (deep-copied per local expert, then
            re-initialised) or a callable ``global_index -> nn.Module`` (a ``SameExperts``
            when every expert is alike).
        num_experts: E, global.
        top_k: experts per token.
        capacity_factor: ``None`` for dropless, else C = ceil(cf * T * k / E) per expert.
        ep_size: expert-parallel size; this rank holds experts of its EP rank.
        ep_rank: this rank's index in its EP group (``Topology.ep_rank(ep_size)``).
        ep_group: the EP process group (``None`` when ep_size == 1).
        expert_group_name: the moe group name used to build optimizer groups.
        aux_loss_coef, z_loss_coef: weights of the aux and z losses in the returned aux loss.
        router: scoring, top-k renormalisation and expert bias (``model/router.py``);
            default: softmax, renormalised, no bias (Mixtral).
        grouped: run the local experts as grouped GEMMs (``moezero.model.experts``) or, when
            False, in a loop (one call per expert; one host sync at ep = 1). ``None`` (default):
            grouped when every expert is the built-in ``SwiGLU`` and torch has a sync-free
            grouped kernel for the input's device and dtype (``has_grouped_kernel``).
    """

    def __init__(self, dim: int, expert: nn.Module | Callable[[int], nn.Module], *,
                 num_experts: int, top_k: int = 2, capacity_factor: float | None = None,
                 ep_size: int = 1, ep_rank: int = 0, ep_group=None,
                 expert_group_name: str | None = None,
                 aux_loss_coef: float = 0.01, z_loss_coef: float = 0.001,
                 router: RouterOptions | None = None,
                 grouped: bool | None = None):
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
        self.router = Router(dim, num_experts, top_k, router or RouterOptions())
        self._expert_source = (expert,)  # a tuple: a template module is not a submodule
        self.experts = nn.ModuleDict({str(e): _make_expert(expert, e) for e in self.local_experts})
        for e, module in self.experts.items():
            for p in module.parameters():
                p.moe = ExpertTag(self.group_name, ep_size, int(e))
        self.builtin = is_builtin(list(self.experts.values()))
        if grouped and not self.builtin:
            raise ValueError("moe: grouped experts need the built-in SwiGLU experts")
        self.grouped = grouped
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
                if isinstance(source, SameExperts):
                    return dict(source.shapes)
                with on_meta():
                    module = source(e)
            except Exception as exc:
                raise ValueError(f"expert {e}: cannot be built on the meta device to read its "
                                 f"shapes: {type(exc).__name__}: {exc}") from None
        return {name: tuple(p.shape) for name, p in module.named_parameters()}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output shaped like x, weighted aux loss = aux_coef*aux + z_coef*z)."""
        x_TD = x.reshape(-1, x.shape[-1])
        logits_TE, probs_TE, gates_Tk, experts_Tk = self.router(x_TD)
        aux, z = aux_losses(logits_TE, probs_TE, experts_Tk, self.num_experts)
        out_TD = self.dispatch(x_TD, experts_Tk, gates_Tk)
        aux_loss = self.aux_loss_coef * aux + self.z_loss_coef * z
        return out_TD.to(x.dtype).reshape(x.shape), aux_loss

    def dispatch(self, x_TD: torch.Tensor, experts_Tk: torch.Tensor,
                 gates_Tk: torch.Tensor) -> torch.Tensor:
        """Each token through its top-k experts, capacity drops applied, outputs weighted by
        the gates and summed in fp32 [T, D]. No host sync at ep = 1 with the grouped experts;
        one (the all-to-all sizes) at ep > 1; none in the backward."""
        num_tokens = x_TD.shape[0]
        cap = capacity(num_tokens, self.num_experts, self.top_k, self.capacity_factor)
        plan = plan_dispatch(experts_Tk, self.num_experts, cap)
        self.last_stats = {"dropped": plan.dropped, "tokens_per_expert": plan.kept_E}
        if self.ep_size == 1:
            rows_AD = gather_tokens(x_TD, plan, num_tokens * self.top_k)
            y_RD = self._apply_local(rows_AD, plan.kept_E, None)
        else:
            y_RD = self._exchange(x_TD, plan)
        return combine(y_RD, gates_Tk.t().reshape(-1), plan)

    def _exchange(self, x_TD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Kept rows to their experts' EP ranks, through the local experts, and back."""
        ex = exchange_sizes(plan.kept_E, self.ep_size, self.ep_group)
        recv_ND = send(gather_tokens(x_TD, plan, ex.kept), ex, self.ep_group)
        order_N, inverse_N = by_local_expert(ex)
        y_ND = self._apply_local(permute_rows(recv_ND, order_N, inverse_N), ex.recv_PL.sum(0),
                                 ex.recv_L)
        return send_back(permute_rows(y_ND, inverse_N, order_N), ex, self.ep_group)

    def uses_grouped(self, x: torch.Tensor) -> bool:
        """Whether the experts run as grouped GEMMs on inputs like ``x``."""
        if self.grouped is not None:
            return self.grouped
        if not self.builtin:
            return False
        first = self.experts[str(self.local_experts[0])]
        return has_grouped_kernel(x.device, x.dtype, dim=first.dim, ffn_dim=first.hidden)

    def _apply_local(self, rows_ND: torch.Tensor, counts_L: torch.Tensor,
                     host_counts: list[int] | None) -> torch.Tensor:
        """Local expert l on its block of rows (empty blocks included). Rows after the blocks
        (dropped assignments at ep = 1) get undefined outputs, masked by ``combine``."""
        modules = [self.experts[str(e)] for e in self.local_experts]
        if self.uses_grouped(rows_ND):
            return grouped_swiglu(rows_ND, counts_L.cumsum(0).to(torch.int32), modules)
        counts = counts_L.tolist() if host_counts is None else host_counts  # the loop's sync
        *chunks, rest = rows_ND.split([*counts, rows_ND.shape[0] - sum(counts)])
        return torch.cat([*(m(c) for m, c in zip(modules, chunks, strict=True)),
                          rest.new_zeros(rest.shape)])


def _make_expert(expert, index: int) -> nn.Module:
    if not isinstance(expert, nn.Module):
        return expert(index)
    module = copy.deepcopy(expert)
    for sub in module.modules():
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    return module
