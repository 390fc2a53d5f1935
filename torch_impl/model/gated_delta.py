"""The gated DeltaNet attention kind (Qwen3-Next's ``linear_attention`` layers): a linear-
attention recurrence with a short causal convolution, at ``layers.N.linear_attn``.

Per token t and value head h (docs/model.md, "Gated DeltaNet"):
    q, k, v = silu(causal depthwise conv(x W_qkv))   (window ``linear_conv_kernel_dim``)
    q, k = l2norm(q), l2norm(k);  q = q / sqrt(Kd)
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)   (log decay, <= 0)
    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T;  o_t = S_t^T q_t
    y = out_proj(rmsnorm(o) * weight * silu(z))
Training runs the chunked form (``gated_delta_rule``): within a chunk of C tokens the delta
updates are solved as one unit-triangular system, across chunks the state is carried, so
memory is O(S·C), not O(S²). With a document mask the state and the convolution window
restart at every document start, so a packed row computes what each document computes alone.

The parameters are stored as Hugging Face's checkpoints hold them (``in_proj_qkvz``,
``in_proj_ba``, ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``). The JAX
counterpart is ``reference/gated_delta.py`` (its recurrent form is the oracle).
Legend: B batch, S sequence, D model dim, C conv channels or chunk length, W conv window,
G key heads, H value heads, K key head dim, V value head dim, N chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moezero.model.kind import AttentionKind, Placement
from moezero.model.packing import DocumentMask


def causal_conv(x_BSC: torch.Tensor, w_CW: torch.Tensor,
                positions_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution: ``out_t = Σ_j w[:, W-1-j] · x_{t-j}``, terms before the
    row (or before the token's document start, ``positions_BS``) taken as zero."""
    window, seq = w_CW.shape[-1], x_BSC.shape[1]
    out = x_BSC * w_CW[:, window - 1]
    for j in range(1, min(window, seq)):
        shifted = F.pad(x_BSC, (0, 0, j, 0))[:, :seq]
        if positions_BS is not None:
            shifted = shifted * (positions_BS >= j)[..., None].to(shifted.dtype)
        out = out + shifted * w_CW[:, window - 1 - j]
    return out


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim (the FLA library's, as transformers')."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _chunked(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, H, S, ...] (S a multiple of ``chunk``) -> [B, H, N, C, ...]."""
    return x.reshape(*x.shape[:2], -1, chunk, *x.shape[3:])


def _segments(starts_BS: torch.Tensor | None, shape, chunk: int, device) -> torch.Tensor:
    """[B, 1, N, C]: how many document starts lie in the chunk at or before each position
    (0: the position still reads the state carried into the chunk)."""
    b, _, s = shape
    if starts_BS is None:
        return torch.zeros(1, 1, s // chunk, chunk, dtype=torch.long, device=device)
    return _chunked(starts_BS[:, None].long(), chunk).cumsum(-1)


def gated_delta_rule(q_BHSK: torch.Tensor, k_BHSK: torch.Tensor, v_BHSV: torch.Tensor,
                     g_BHS: torch.Tensor, beta_BHS: torch.Tensor,
                     starts_BS: torch.Tensor | None = None, chunk: int = 64) -> torch.Tensor:
    """The gated delta rule over chunks of ``chunk`` tokens (fp32 inputs, q already scaled);
    the state restarts at zero wherever ``starts_BS`` is True. Returns o [B, H, S, V]."""
    s = q_BHSK.shape[2]
    pad = (-s) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q_BHSK, k_BHSK, v_BHSV))
    g, beta = (F.pad(x, (0, pad)) for x in (g_BHS, beta_BHS))
    starts = None if starts_BS is None else F.pad(starts_BS, (0, pad))
    seg_B1NC = _segments(starts, g.shape, chunk, g.device)
    q, k, v, g, beta = (_chunked(x, chunk) for x in (q, k, v, g, beta))
    cum_BHNC = g.cumsum(-1)
    tril_CC = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).tril()
    within_B1NCC = (seg_B1NC[..., :, None] == seg_B1NC[..., None, :]) & tril_CC
    decay_BHNCC = (cum_BHNC[..., :, None] - cum_BHNC[..., None, :]).masked_fill(
        ~within_B1NCC, float("-inf")).exp()
    k_beta = k * beta[..., None]
    fresh = (seg_B1NC == 0)[..., None].to(q.dtype)  # reads the carried state
    survives = (seg_B1NC == seg_B1NC[..., -1:])[..., None].to(q.dtype)  # reaches the chunk end
    system = (k_beta @ k.transpose(-1, -2)) * decay_BHNCC
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                      unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum_BHNC.exp()[..., None] * fresh,
                                      upper=False, unitriangular=True)
    local = (q @ k.transpose(-1, -2)) * decay_BHNCC
    q_in = q * cum_BHNC.exp()[..., None] * fresh
    k_out = k * (cum_BHNC[..., -1:] - cum_BHNC).exp()[..., None] * survives
    carry = cum_BHNC[..., -1].exp() * (seg_B1NC[..., -1] == 0)
    return _scan(q_in, k_out, u, w, local, carry)[:, :, :s]


def _scan(q_in, k_out, u, w, local, carry_BHN) -> torch.Tensor:
    """The sequential pass over chunks: each chunk reads the carried state [B, H, K, V],
    corrects its values by what the state already predicts (the delta), then updates it."""
    b, h, n, c, _ = u.shape
    state = u.new_zeros(b, h, q_in.shape[-1], u.shape[-1])
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_in[:, :, i] @ state + local[:, :, i] @ v_new)
        state = state * carry_BHN[:, :, i, None, None] + k_out[:, :, i].transpose(-1, -2) @ v_new
    return torch.cat(outs, dim=2)


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x) * weight * silu(z)`` over each value head's V dims (the norm in fp32, as
    transformers' ``Qwen3NextRMSNormGated``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixing with G key heads (dim K) and H value heads (dim V; G
    divides H: key head g serves value heads g·H/G .. (g+1)·H/G - 1).

    ``in_proj_qkvz`` [G·(2K + 2V·H/G), D] holds per key head its q, k, then its value heads'
    v and z; ``in_proj_ba`` [2H, D] per key head its value heads' b then a (the checkpoint's
    interleaving); ``conv1d.weight`` [2GK + HV, 1, W]; ``dt_bias``, ``A_log`` [H];
    ``norm.weight`` [V]; ``out_proj`` [D, HV].
    """

    lora_owner, lora_projections = "linear_attn", ("in_proj_qkvz", "in_proj_ba", "out_proj")

    def __init__(self, args):
        super().__init__()
        d, self.chunk = args.dim, args.gated_delta_chunk
        self.g, self.h = args.linear_num_key_heads, args.linear_num_value_heads
        self.k, self.v = args.linear_key_head_dim, args.linear_value_head_dim
        r = self.h // self.g
        channels = 2 * self.g * self.k + self.h * self.v
        self.in_proj_qkvz = nn.Linear(d, self.g * (2 * self.k + 2 * r * self.v), bias=False)
        self.in_proj_ba = nn.Linear(d, 2 * self.h, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, args.linear_conv_kernel_dim, groups=channels,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.h))
        self.A_log = nn.Parameter(torch.zeros(self.h))
        self.norm = GatedRMSNorm(self.v, args.norm_eps)
        self.out_proj = nn.Linear(self.h * self.v, d, bias=False)

    def _project(self, x_BSD: torch.Tensor):
        """(qkv [B, S, 2GK + HV] before the conv, z [B, S, H, V], b, a [B, S, H])."""
        b, s, _ = x_BSD.shape
        r = self.h // self.g
        qkvz = self.in_proj_qkvz(x_BSD).view(b, s, self.g, -1)
        q, k, v, z = qkvz.split([self.k, self.k, r * self.v, r * self.v], dim=-1)
        ba_beta, ba_a = self.in_proj_ba(x_BSD).view(b, s, self.g, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
        heads = (b, s, self.h)
        return qkv, z.reshape(*heads, self.v), ba_beta.reshape(heads), ba_a.reshape(heads)

    def forward(self, x_BSD: torch.Tensor, docs: DocumentMask | None = None) -> torch.Tensor:
        b, s, _ = x_BSD.shape
        qkv, z, beta_in, a = self._project(x_BSD)
        pos = None if docs is None else docs.positions_BS
        qkv = F.silu(causal_conv(qkv, self.conv1d.weight[:, 0], pos))
        q, k, v = qkv.split([self.g * self.k, self.g * self.k, self.h * self.v], dim=-1)
        q, k = (l2norm(x.float().view(b, s, self.g, self.k)) for x in (q, k))
        q, k = (x.repeat_interleave(self.h // self.g, dim=2).transpose(1, 2) for x in (q, k))
        q = q * self.k ** -0.5
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o_BHSV = gated_delta_rule(q, k, v.float().view(b, s, self.h, self.v).transpose(1, 2),
                                  g.transpose(1, 2), beta_in.sigmoid().float().transpose(1, 2),
                                  None if pos is None else pos == 0, self.chunk)
        o_BSHV = self.norm(o_BHSV.transpose(1, 2).to(x_BSD.dtype), z)
        return self.out_proj(o_BSHV.reshape(b, s, self.h * self.v))


def _modules(args, at: Placement) -> dict[str, nn.Module]:
    return {"linear_attn": GatedDeltaNet(args)}


def _apply(block: nn.Module, x_BSD: torch.Tensor, docs: DocumentMask | None) -> torch.Tensor:
    return block.linear_attn(x_BSD, docs)


GATED_DELTA = AttentionKind("gated_delta", _modules, _apply, hf_names={
    f"linear_attn.{p}": f"linear_attn.{p}" for p in (
        "in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log",
        "norm.weight", "out_proj.weight")})
"""Gated DeltaNet at ``layers.N.linear_attn`` (the layers ``model.gated_delta_layers`` names),
under Qwen3-Next's own names."""
