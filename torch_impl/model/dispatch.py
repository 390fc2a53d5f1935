"""MoE token dispatch without host syncs: a permutation plan, row gathers, combine, EP exchange.

The router's top-k choices become a permutation of the T·k assignments computed on the
device with static shapes: one stable sort by expert, the capacity test on each assignment's
rank within its expert, and the kept assignments packed first (grouped by expert, in drop
order), the dropped ones after them. Rows move only by gathers whose backward is again a
gather (``_Rows``, ``_TokenRows``), so the backward has no atomic scatter and no sync, and the
results do not depend on kernel scheduling. The only host read is the all-to-all split sizes
at ep > 1 (``exchange_sizes``, one ``tolist`` per layer forward); at ep = 1 the grouped
experts need none. Semantics (drop order, capacity) are docs/model.md's; the JAX counterpart
is ``reference/moe.py`` (``assign_slots``, ``dispatch``, ``combine``).

Legend: T tokens, D model dim, E experts (global), k top-k, A = T·k assignments in drop order
(choice-major: a = j·T + t), R rows handed on (A at ep = 1, the K kept ones at ep > 1),
P EP size, L local experts, N rows received from the EP group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


def capacity(num_tokens: int, num_experts: int, top_k: int,
             capacity_factor: float | None) -> int | None:
    """Slots per expert, ``ceil(cf * T * k / E)`` in float64; None when dropless."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


@dataclass(frozen=True)
class DispatchPlan:
    """Where each assignment goes; device tensors only, nothing read on the host.

    Row r of the experts' input holds assignment ``order_A[r]``; assignment a sits at row
    ``position_A[a]``. Rows [0, K) are the kept assignments grouped by expert (K = kept_E.sum()),
    rows [K, A) the dropped ones.
    """

    num_tokens: int
    top_k: int
    order_A: torch.Tensor
    position_A: torch.Tensor
    keep_A: torch.Tensor  # bool, assignment order
    row_A: torch.Tensor  # position_A, with 0 for dropped assignments (masked wherever read)
    routed_E: torch.Tensor  # assignments per expert before drops (int64)
    kept_E: torch.Tensor  # rows per expert after drops (int64)

    @property
    def dropped(self) -> torch.Tensor:
        """Dropped assignments, a 0-d tensor."""
        return self.num_tokens * self.top_k - self.kept_E.sum()


def plan_dispatch(experts_Tk: torch.Tensor, num_experts: int, cap: int | None) -> DispatchPlan:
    """The permutation of docs/model.md's drop order: choice-major, then token, per expert."""
    num_tokens, top_k = experts_Tk.shape
    expert_A = experts_Tk.t().reshape(-1)
    arange_A = torch.arange(expert_A.numel(), device=expert_A.device)
    by_expert_S = torch.argsort(expert_A, stable=True)  # S: slot in expert order
    expert_S = expert_A.index_select(0, by_expert_S)
    bounds = torch.searchsorted(expert_S, torch.arange(num_experts + 1, device=expert_A.device))
    routed_E = bounds.diff()
    kept_E = routed_E if cap is None else routed_E.clamp(max=cap)
    kept_start_E = kept_E.cumsum(0) - kept_E
    rank_S = arange_A - bounds[:-1].index_select(0, expert_S)  # rank within its expert
    keep_S = rank_S < kept_E.index_select(0, expert_S)
    dropped_before_S = arange_A - (kept_start_E + kept_E).index_select(0, expert_S)
    row_S = torch.where(keep_S, kept_start_E.index_select(0, expert_S) + rank_S,
                        kept_E.sum() + dropped_before_S)
    position_A = torch.empty_like(row_S).scatter_(0, by_expert_S, row_S)
    order_A = torch.empty_like(row_S).scatter_(0, row_S, by_expert_S)
    keep_A = torch.empty_like(keep_S).scatter_(0, by_expert_S, keep_S)
    return DispatchPlan(num_tokens, top_k, order_A, position_A, keep_A,
                        torch.where(keep_A, position_A, 0), routed_E, kept_E)


class _Rows(torch.autograd.Function):
    """``x[index]`` with the gather ``grad[inverse]`` as backward.

    Exact when row r of x is read by ``inverse[r]`` and by no other entry whose gradient is
    nonzero (dropped assignments read row 0 but are masked before any gradient reaches them).
    """

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _TokenRows(torch.autograd.Function):
    """Rows of the first R assignments, taken from their tokens; the backward gathers each
    token's k assignment gradients (dropped ones masked) and sums them over k in a fixed order."""

    @staticmethod
    def forward(ctx, x_TD, source_R, row_A, keep_A, top_k: int):
        ctx.save_for_backward(row_A, keep_A)
        ctx.top_k = top_k
        return x_TD.index_select(0, source_R)

    @staticmethod
    def backward(ctx, g_RD):
        row_A, keep_A = ctx.saved_tensors
        g_AD = torch.where(keep_A[:, None], g_RD.index_select(0, row_A), 0)
        return g_AD.view(ctx.top_k, -1, g_RD.shape[-1]).sum(0), None, None, None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for a permutation ``index`` whose inverse is ``inverse`` (gather backward)."""
    return _Rows.apply(x, index, inverse)


def gather_tokens(x_TD: torch.Tensor, plan: DispatchPlan, rows: int) -> torch.Tensor:
    """The experts' input: the first ``rows`` rows of the plan's order (R = A or K)."""
    source_R = plan.order_A[:rows] % plan.num_tokens
    return _TokenRows.apply(x_TD, source_R, plan.row_A, plan.keep_A, plan.top_k)


def combine(y_RD: torch.Tensor, gates_A: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """``out_t = sum_j gate_tj * y[row of (t, j)]`` over kept assignments, in fp32 [T, D].

    Rows past K (undefined at ep = 1) are read only by dropped assignments and masked.
    """
    y_AD = _Rows.apply(y_RD, plan.row_A, plan.order_A[:y_RD.shape[0]])
    y_AD = torch.where(plan.keep_A[:, None], y_AD.float(), 0.0)
    y_kTD = (y_AD * gates_A[:, None]).view(plan.top_k, plan.num_tokens, -1)
    return y_kTD.sum(0)


# ------------------------------------------------------------------------------ EP exchange


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


@dataclass(frozen=True)
class Exchange:
    """Split sizes of one EP exchange, on the host, and the received rows' layout."""

    send_P: list[int]  # rows sent to each EP rank
    recv_P: list[int]  # rows received from each EP rank
    recv_L: list[int]  # rows received per local expert (for the generic expert loop)
    recv_PL: torch.Tensor  # rows from source rank p for local expert l (device)

    @property
    def kept(self) -> int:
        return sum(self.send_P)

    @property
    def received(self) -> int:
        return sum(self.recv_P)


def exchange_sizes(kept_E: torch.Tensor, ep_size: int, group) -> Exchange:
    """Swap per-expert counts with the EP group; the layer's one host sync reads the sizes."""
    send_PL = kept_E.view(ep_size, -1)
    recv_PL = torch.empty_like(send_PL)
    dist.all_to_all_single(recv_PL, send_PL.contiguous(), group=group)
    sizes = torch.cat([send_PL.sum(1), recv_PL.sum(1), recv_PL.sum(0)]).tolist()
    return Exchange(sizes[:ep_size], sizes[ep_size:2 * ep_size], sizes[2 * ep_size:], recv_PL)


def send(rows_KD: torch.Tensor, ex: Exchange, group) -> torch.Tensor:
    """Rows (sorted by expert, hence by owner) to their EP ranks; [N, D] by (source, expert)."""
    return _AllToAll.apply(rows_KD, ex.recv_P, ex.send_P, group)


def send_back(y_ND: torch.Tensor, ex: Exchange, group) -> torch.Tensor:
    """The experts' outputs back to the ranks that sent the rows, in their order."""
    return _AllToAll.apply(y_ND, ex.send_P, ex.recv_P, group)


def by_local_expert(ex: Exchange) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse) regrouping received rows from (source rank, expert) to (expert, source)."""
    ep_size, num_local = ex.recv_PL.shape
    device = ex.recv_PL.device
    expert_N = torch.repeat_interleave(torch.arange(num_local, device=device).repeat(ep_size),
                                       ex.recv_PL.reshape(-1), output_size=ex.received)
    order_N = torch.argsort(expert_N, stable=True)
    inverse_N = torch.empty_like(order_N).scatter_(
        0, order_N, torch.arange(ex.received, device=device))
    return order_N, inverse_N
