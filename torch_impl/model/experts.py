"""The built-in SwiGLU expert and the grouped-GEMM path that runs all local experts at once.

``MoE`` keeps one ``SwiGLU`` module per local expert (FQNs ``experts.<global index>.w1.weight``
etc., one optimizer group per (layer, expert)); when every local expert is a built-in
``SwiGLU`` and torch has a sync-free grouped kernel for the device and dtype
(``has_grouped_kernel``), ``grouped_swiglu`` runs them as three
``torch.nn.functional.grouped_mm`` calls over the stacked weights instead of three GEMMs per
expert.

**Stacking rule** (docs/model.md): the L local ``w1`` tensors (likewise ``w3``, ``w2``) are
*viewed* as one [L, F, D] tensor when they lie in one storage at a constant element stride,
16-byte aligned (what ZeRO stages 1-2 make: a kind's flat buffer holds a layer's local experts
back to back, each expert's w1, w2, w3 consecutive); otherwise (stage 0, stage 3, a bare model)
they are copied by ``torch.stack``. The autograd function saves the per-expert parameters, not
the stack, so a copy lives only during the forward and is made again in the backward (stage 3
keeps releasing the gathered weights); the weight gradients come back per expert.

**LoRA** (``moezero.model.lora``): when the experts' projections carry adapters
(``lora_A`` [R, I], ``lora_B`` [O, R] per expert), each projection is three grouped GEMMs
(``GroupedLinear``: base, A, B over the same row groups), the SwiGLU in between left to
autograd; the frozen base weights get no weight gradient computed.

Rows past ``offs[-1]`` (dropped assignments at ep = 1) are not computed: their outputs and
input gradients are undefined and must be masked by the caller (``moezero.model.dispatch``).
Legend: N rows, D model dim, F expert hidden dim, L local experts.
Reference counterpart: ``reference/moe.py`` (``swiglu``, ``apply_experts``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.torch_version import TorchVersion

ALIGN_BYTES = 16  # grouped GEMM kernels on CUDA need 16-byte aligned bases and strides


def gated(h1: torch.Tensor, h3: torch.Tensor, limit: float | None = None,
          alpha: float = 1.702) -> torch.Tensor:
    """The gated activation of gate ``h1`` and up ``h3``: ``silu(h1) * h3``, or with ``limit``
    gpt-oss's clamped form ``(clamp(h3, ±limit) + 1) · g · sigmoid(alpha · g)``, ``g = min(h1,
    limit)`` (``moe.swiglu_limit``, ``moe.swiglu_alpha``)."""
    if limit is None:
        return F.silu(h1) * h3
    g = h1.clamp(max=limit)
    return (h3.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha))


class SwiGLU(nn.Module):
    """The default expert: ``w2(silu(w1 x) * w3 x)``; with ``bias`` each projection has one,
    with ``limit`` the activation is ``gated``'s clamped form (gpt-oss)."""

    lora_owner, lora_projections = "experts", ("w1", "w2", "w3")  # moezero.model.lora

    def __init__(self, dim: int, hidden: int, *, bias: bool = False,
                 limit: float | None = None, alpha: float = 1.702):
        super().__init__()
        self.dim, self.hidden, self.limit, self.alpha = dim, hidden, limit, alpha
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.w2(gated(self.w1(x_ND), self.w3(x_ND), self.limit, self.alpha))


def is_builtin(modules: Sequence[nn.Module]) -> bool:
    """True when every module is exactly the built-in ``SwiGLU`` (not a subclass) and all have
    the same weight shapes (a factory may build experts of different widths: those take the
    generic loop, since one grouped GEMM needs one shape)."""
    if not modules or any(type(m) is not SwiGLU for m in modules):
        return False
    shapes = {tuple(tuple(p.shape) for p in m.parameters()) for m in modules}
    return len(shapes) == 1


GROUPED_MM_SINCE = "2.10"  # torch.nn.functional.grouped_mm is public from this release
GROUPED_CAPABILITIES = (9,)
"""CUDA compute capabilities (major) whose grouped GEMM is trusted: 9.x (H100/H200, torch's
CUTLASS kernels). 10.x (B200) is left out: a reported torch bug gives experts with no tokens
non-zero weight gradients there in some versions; 8.x and older get torch's syncing fallback."""


def grouped_kernel_ok(*, torch_version: str, device_type: str,
                      capability: tuple[int, int] | None, dtype: torch.dtype, dim: int,
                      ffn_dim: int) -> bool:
    """The grouped-GEMM gate as a pure function of the facts it reads (tested as a table).

    True on CPU and on CUDA in bf16 at a trusted capability (``GROUPED_CAPABILITIES``) with
    16-byte row strides (``dim`` and ``ffn_dim`` multiples of 8 in bf16), from torch
    ``GROUPED_MM_SINCE`` on. Elsewhere torch falls back to a loop over the groups that copies
    the offsets to the host on every call (3 syncs per forward, 6 per backward), worse than the
    generic loop's one, or the kernel is missing or wrong.
    """
    if TorchVersion(torch_version) < GROUPED_MM_SINCE:
        return False
    if device_type == "cpu":
        return True
    if device_type != "cuda" or dtype != torch.bfloat16 or capability is None:
        return False
    per_row = ALIGN_BYTES // dtype.itemsize
    return (capability[0] in GROUPED_CAPABILITIES and dim % per_row == 0
            and ffn_dim % per_row == 0)


def has_grouped_kernel(device: torch.device, dtype: torch.dtype, *, dim: int,
                       ffn_dim: int) -> bool:
    """``grouped_kernel_ok`` for this torch and ``device`` (experts of ``dim`` x ``ffn_dim``)."""
    capability = (torch.cuda.get_device_capability(device)
                  if device.type == "cuda" and torch.cuda.is_available() else None)
    return hasattr(F, "grouped_mm") and grouped_kernel_ok(
        torch_version=torch.__version__, device_type=device.type, capability=capability,
        dtype=dtype, dim=dim, ffn_dim=ffn_dim)


def strided_view(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """[L, *shape] view of L same-shaped tensors at a constant stride in one storage, or None."""
    first = weights[0]
    if not all(w.shape == first.shape and w.dtype == first.dtype and w.device == first.device
               and w.is_contiguous() for w in weights):
        return None
    base = first.untyped_storage().data_ptr()
    if any(w.untyped_storage().data_ptr() != base for w in weights):
        return None
    step = weights[1].storage_offset() - first.storage_offset() if len(weights) > 1 else first.numel()
    if step < first.numel() or any(w.storage_offset() != first.storage_offset() + i * step
                                   for i, w in enumerate(weights)):
        return None
    if first.data_ptr() % ALIGN_BYTES or (step * first.element_size()) % ALIGN_BYTES:
        return None
    return first.as_strided((len(weights), *first.shape), (step, *first.stride()))


def stack_weights(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The stacking rule: a view where ``strided_view`` allows it, else a copy."""
    view = strided_view(weights)
    return view if view is not None else torch.stack(list(weights))


def _projections(modules: Sequence[SwiGLU]) -> tuple[list[torch.Tensor], ...]:
    return tuple([getattr(m, name).weight for m in modules] for name in ("w1", "w3", "w2"))


def stacking_mode(modules: Sequence[SwiGLU]) -> str:
    """``view`` when all three projections are viewed (no copy), else ``copy``."""
    return "view" if all(strided_view(ws) is not None for ws in _projections(modules)) else "copy"


class _GroupedSwiGLU(torch.autograd.Function):
    """SwiGLU over row groups; inputs (x, offs, L, w1 x L, w3 x L, w2 x L)."""

    @staticmethod
    def forward(ctx, x_ND, offs_L, num_local: int, *weights):
        w1, w3, w2 = (stack_weights(weights[i * num_local:(i + 1) * num_local]) for i in range(3))
        h1_NF = F.grouped_mm(x_ND, w1.transpose(-2, -1), offs=offs_L)
        h3_NF = F.grouped_mm(x_ND, w3.transpose(-2, -1), offs=offs_L)
        y_ND = F.grouped_mm(F.silu(h1_NF) * h3_NF, w2.transpose(-2, -1), offs=offs_L)
        ctx.num_local = num_local
        ctx.save_for_backward(x_ND, offs_L, h1_NF, h3_NF, *weights)
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, offs_L, h1_NF, h3_NF, *weights = ctx.saved_tensors
        n = ctx.num_local
        w1, w3, w2 = (stack_weights(weights[i * n:(i + 1) * n]) for i in range(3))
        dy_ND = dy_ND.contiguous()  # grouped_mm rejects expanded (stride-0) gradients
        a_NF = F.silu(h1_NF)
        dg_NF = F.grouped_mm(dy_ND, w2, offs=offs_L)
        dw2 = F.grouped_mm(dy_ND.t(), a_NF * h3_NF, offs=offs_L)
        dh3_NF = dg_NF * a_NF
        dh1_NF = torch.ops.aten.silu_backward(dg_NF * h3_NF, h1_NF)
        dx_ND = None
        if ctx.needs_input_grad[0]:
            dx_ND = F.grouped_mm(dh1_NF, w1, offs=offs_L) + F.grouped_mm(dh3_NF, w3, offs=offs_L)
        dw1 = F.grouped_mm(dh1_NF.t(), x_ND, offs=offs_L)
        dw3 = F.grouped_mm(dh3_NF.t(), x_ND, offs=offs_L)
        return dx_ND, None, None, *dw1.unbind(0), *dw3.unbind(0), *dw2.unbind(0)


class GroupedLinear(torch.autograd.Function):
    """``x W_l^T`` on row group l; inputs (x [N, I], offs, W_0 .. W_{L-1} [O, I]). Saves the
    per-expert weights (not a stack), like ``_GroupedSwiGLU``; weight gradients only for the
    weights that need them (frozen base weights: none). Dims whose rows would not be
    ``ALIGN_BYTES`` apart (a LoRA rank of 4 in bf16) are zero-padded for the kernels."""

    @staticmethod
    def forward(ctx, x_NI, offs_L, *weights):
        ctx.save_for_backward(x_NI, offs_L, *weights)
        w_LOI = _aligned(_aligned(stack_weights(weights), -1), -2)
        y_NO = F.grouped_mm(_aligned(x_NI, -1), w_LOI.transpose(-2, -1), offs=offs_L)
        return y_NO[:, :weights[0].shape[0]]

    @staticmethod
    def backward(ctx, dy_NO):
        x_NI, offs_L, *weights = ctx.saved_tensors
        (o, i), dx_NI = weights[0].shape, None
        dy_NO = _aligned(dy_NO.contiguous(), -1)  # grouped_mm rejects stride-0 gradients
        if ctx.needs_input_grad[0]:
            w_LOI = _aligned(_aligned(stack_weights(weights), -1), -2)
            dx_NI = F.grouped_mm(dy_NO, w_LOI, offs=offs_L)[:, :i]
        dws = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            dw_LOI = F.grouped_mm(dy_NO.t(), _aligned(x_NI, -1), offs=offs_L)
            dws = list(dw_LOI[:, :o, :i].unbind(0))
        return dx_NI, None, *dws


def _aligned(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` zero-padded along ``dim`` to a multiple of ``ALIGN_BYTES`` (itself if it is)."""
    step = ALIGN_BYTES // t.element_size()
    extra = -t.shape[dim] % step
    if not extra:
        return t
    pad = [0, 0] * (-dim - 1) + [0, extra]
    return F.pad(t, pad)


def row_groups(offs_L: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The group of each of ``num_rows`` rows (int64 [N]); rows past ``offs[-1]`` get the last
    group (their outputs are undefined anyway)."""
    rows_N = torch.arange(num_rows, device=offs_L.device, dtype=offs_L.dtype)
    return torch.searchsorted(offs_L, rows_N, right=True).clamp_(max=offs_L.numel() - 1)


def _grouped_projection(x_NI: torch.Tensor, offs_L: torch.Tensor,
                        linears: Sequence[nn.Linear]) -> torch.Tensor:
    """One projection of every local expert, with its bias (each row gathers its expert's,
    no loop) and its LoRA adapters if it has them."""
    y_NO = GroupedLinear.apply(x_NI, offs_L, *(m.weight for m in linears))
    first = linears[0]
    if first.bias is not None:
        bias_LO = torch.stack([m.bias for m in linears])
        y_NO = y_NO + bias_LO[row_groups(offs_L, x_NI.shape[0])]
    if not hasattr(first, "lora_A"):
        return y_NO
    h_NR = GroupedLinear.apply(first.lora_dropout(x_NI), offs_L, *(m.lora_A for m in linears))
    return y_NO + first.scale * GroupedLinear.apply(h_NR, offs_L, *(m.lora_B for m in linears))


def grouped_swiglu(x_ND: torch.Tensor, offs_L: torch.Tensor,
                   modules: Sequence[SwiGLU]) -> torch.Tensor:
    """Run expert i of ``modules`` on rows [offs[i-1], offs[i]) of ``x_ND`` (int32 ends). With
    adapters, biases or the clamped activation: grouped projections with autograd between."""
    first = modules[0]
    if (first.limit is not None or first.w1.bias is not None
            or any(hasattr(getattr(first, n), "lora_A") for n in ("w1", "w3", "w2"))):
        h1_NF, h3_NF = (_grouped_projection(x_ND, offs_L, [getattr(m, n) for m in modules])
                        for n in ("w1", "w3"))
        h_NF = gated(h1_NF, h3_NF, first.limit, first.alpha)
        return _grouped_projection(h_NF, offs_L, [m.w2 for m in modules])
    w1s, w3s, w2s = _projections(modules)
    return _GroupedSwiGLU.apply(x_ND, offs_L, len(modules), *w1s, *w3s, *w2s)
