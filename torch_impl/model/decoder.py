"""A Mixtral-style decoder: RMSNorm, RoPE, causal attention, SwiGLU experts in MoE layers.

Semantics and FQNs are docs/model.md; the JAX counterpart is ``reference/model.py``.
Legend: B batch, S sequence, D model dim, H heads, K head dim, V vocab.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moezero.model.moe import MoE, SwiGLU


@dataclass(frozen=True)
class ModelArgs:
    """Shape and MoE settings of the decoder (filled from ``Config.model`` and ``Config.moe``)."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = None
    ep_size: int = 1
    expert_group_name: str | None = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rope(x_BSHK: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split rotary embedding (HF ``rotate_half`` convention), positions 0..S-1."""
    seq, half = x_BSHK.shape[1], x_BSHK.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x_BSHK.device) / half)
    angle_SK = torch.arange(seq, dtype=torch.float32, device=x_BSHK.device)[:, None] * inv_freq
    cos, sin = angle_SK.cos()[None, :, None, :], angle_SK.sin()[None, :, None, :]
    x1, x2 = x_BSHK.float()[..., :half], x_BSHK.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BSHK.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.theta = args.n_heads, args.rope_theta
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False)
                                              for _ in range(4))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        b, s, d = x_BSD.shape
        q, k, v = (w(x_BSD).view(b, s, self.n_heads, d // self.n_heads)
                   for w in (self.wq, self.wk, self.wv))
        q, k = rope(q, self.theta), rope(k, self.theta)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, *, ep_rank: int = 0, ep_group=None):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(args.dim, lambda e: SwiGLU(args.dim, args.ffn_dim),
                       num_experts=args.num_experts, top_k=args.top_k,
                       capacity_factor=args.capacity_factor, ep_size=args.ep_size,
                       ep_rank=ep_rank, ep_group=ep_group,
                       expert_group_name=args.expert_group_name,
                       aux_loss_coef=args.aux_loss_coef, z_loss_coef=args.z_loss_coef)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + self.attn(self.attn_norm(h))
        y, aux = self.moe(self.ffn_norm(h))
        return h + y, aux


class Decoder(nn.Module):
    """Token ids [B, S] -> logits [B, S, V]; ``loss`` adds the MoE aux losses."""

    def __init__(self, args: ModelArgs, *, ep_rank: int = 0, ep_group=None):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, ep_rank=ep_rank, ep_group=ep_group)
                                    for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits_BSV, summed weighted aux loss of all MoE layers)."""
        h = self.embed(tokens_BS)
        aux_total = torch.zeros((), device=h.device)
        for layer in self.layers:
            h, aux = layer(h)
            aux_total = aux_total + aux
        return self.lm_head(self.norm(h)), aux_total

    def loss(self, batch_BS1: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean next-token cross-entropy of a [B, S+1] batch plus the aux losses."""
        logits_BSV, aux = self(batch_BS1[:, :-1])
        ce = F.cross_entropy(logits_BSV.float().flatten(0, 1), batch_BS1[:, 1:].flatten())
        return ce + aux, {"ce": ce.detach(), "aux_loss": aux.detach()}


def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic init keyed by FQN: the same weights for any world size or EP layout.

    Norm gains are 1; output projections (``wo``, ``w2``) get std/sqrt(2L) (docs/model.md).
    """
    n_layers = getattr(getattr(model, "args", None), "n_layers", 1)
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            if param.ndim == 1:
                param.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(fqn.encode()))
            scale = std / math.sqrt(2 * n_layers) if fqn.endswith(("wo.weight", "w2.weight")) else std
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
