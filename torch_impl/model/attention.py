"""Causal self-attention of the decoder: grouped-query heads, optional QK-norm and biases, RoPE;
the attention kind ``GQA`` (``moezero.model.kind``), with its Hugging Face names.

Semantics are docs/model.md ("Attention"); the JAX counterpart is ``reference/model.py:
attention``. Legend: B batch, S sequence, D model dim, H query heads, G key/value heads,
K head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moezero.model.kind import AttentionKind, Placement
from moezero.model.packing import DocumentMask
from moezero.model.rope import Yarn, attention_factor, inv_frequencies
from moezero.model.sinks import allowed_keys, sink_attention

QK_NORMS = ("none", "head", "projection")
"""``model.qk_norm``: none; RMSNorm over each head's K dims (Qwen3-MoE); RMSNorm over the whole
q and k projections, before the head split (OLMoE)."""

ATTN_BIASES = ("none", "qkv", "all")
"""``model.attn_bias``: no biases; on the q, k and v projections (Qwen2-MoE); on those and the
output projection (``attention_bias`` of OLMoE and Qwen3-MoE)."""


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x², -1) + eps) * g``, computed in fp32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rope(x_BSHK: torch.Tensor, theta: float, positions_BS: torch.Tensor | None = None,
         rotary_dim: int | None = None, *, yarn: Yarn | None = None) -> torch.Tensor:
    """Half-split rotary embedding (HF ``rotate_half`` convention), positions 0..S-1 or
    ``positions_BS`` (a document mask's, restarting per document). ``rotary_dim`` (even):
    only each head's first that many dims rotate, with frequencies of that width, the rest
    pass through (``model.partial_rotary_factor``); None = all K. ``yarn``: YaRN-scaled
    frequencies (of the rotated width, as transformers) and cos/sin (``moezero.model.rope``)."""
    if rotary_dim is not None and rotary_dim < x_BSHK.shape[-1]:
        rotated = rope(x_BSHK[..., :rotary_dim], theta, positions_BS, yarn=yarn)
        return torch.cat([rotated, x_BSHK[..., rotary_dim:]], dim=-1)
    seq, half = x_BSHK.shape[1], x_BSHK.shape[-1] // 2
    inv_freq = inv_frequencies(2 * half, theta, yarn, x_BSHK.device)
    if positions_BS is None:
        pos = torch.arange(seq, dtype=torch.float32, device=x_BSHK.device)[None, :]
    else:
        pos = positions_BS.to(torch.float32)
    angle_BSK = pos[..., None] * inv_freq
    cos, sin = angle_BSK.cos()[:, :, None, :], angle_BSK.sin()[:, :, None, :]
    if yarn is not None:
        cos, sin = cos * attention_factor(yarn), sin * attention_factor(yarn)
    x1, x2 = x_BSHK.float()[..., :half], x_BSHK.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BSHK.dtype)


class Attention(nn.Module):
    """Causal attention with H query heads sharing G key/value heads (G divides H; G = H is
    multi-head attention). ``wq`` is [H·K, D], ``wk``/``wv`` [G·K, D], ``wo`` [D, H·K]: the
    key/value projections are never expanded to H heads.

    Args:
        args: the decoder's ``ModelArgs`` (``dim``, ``n_heads``, ``kv_heads``, ``head_size``,
            ``rope_theta``, ``rotary_dim``, ``norm_eps``, ``qk_norm``, ``attn_bias``,
            ``attn_sinks``, ``yarn``).
        window: this layer's sliding window (``ModelArgs.window``), or None.
    """

    lora_owner, lora_projections = "attn", ("wq", "wk", "wv", "wo")  # moezero.model.lora

    def __init__(self, args, window: int | None = None):
        super().__init__()
        d, h, g, k = args.dim, args.n_heads, args.kv_heads, args.head_size
        self.n_heads, self.n_kv_heads, self.head_dim = h, g, k
        self.theta, self.qk_norm = args.rope_theta, args.qk_norm
        self.rotary_dim, self.output_gate = args.rotary_dim, args.attn_output_gate
        self.window, self.yarn = window, getattr(args, "yarn", None)
        qkv_bias = args.attn_bias != "none"
        # With the output gate, wq holds per head its K query rows then its K gate rows.
        self.wq = nn.Linear(d, h * k * (2 if self.output_gate else 1), bias=qkv_bias)
        self.wk = nn.Linear(d, g * k, bias=qkv_bias)
        self.wv = nn.Linear(d, g * k, bias=qkv_bias)
        self.wo = nn.Linear(h * k, d, bias=args.attn_bias == "all")
        if args.qk_norm != "none":
            per_head = args.qk_norm == "head"
            self.q_norm = RMSNorm(k if per_head else h * k, args.norm_eps)
            self.k_norm = RMSNorm(k if per_head else g * k, args.norm_eps)
        if getattr(args, "attn_sinks", False):
            self.sinks = nn.Parameter(torch.zeros(h))

    def forward(self, x_BSD: torch.Tensor, docs: DocumentMask | None = None) -> torch.Tensor:
        """Causal attention over the row, or within each document of ``docs``."""
        b, s, _ = x_BSD.shape
        q, k, v = self.wq(x_BSD), self.wk(x_BSD), self.wv(x_BSD)
        if self.output_gate:
            q, gate = q.view(b, s, self.n_heads, 2, self.head_dim).unbind(3)
            q = q.reshape(b, s, -1)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q_BSHK = q.view(b, s, self.n_heads, self.head_dim)
        k_BSGK = k.view(b, s, self.n_kv_heads, self.head_dim)
        v_BSGK = v.view(b, s, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q_BSHK, k_BSGK = self.q_norm(q_BSHK), self.k_norm(k_BSGK)
        pos = None if docs is None else docs.positions_BS
        q_BSHK = rope(q_BSHK, self.theta, pos, self.rotary_dim, yarn=self.yarn)
        k_BSGK = rope(k_BSGK, self.theta, pos, self.rotary_dim, yarn=self.yarn)
        q, k, v = q_BSHK.transpose(1, 2), k_BSGK.transpose(1, 2), v_BSGK.transpose(1, 2)
        allowed = allowed_keys(s, x_BSD.device, docs, self.window)
        if hasattr(self, "sinks"):
            out = sink_attention(q, k, v, self.sinks, allowed)
        else:  # query head h reads key/value head h // (H/G), as transformers' repeat_kv
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, is_causal=allowed is None,
                enable_gqa=self.n_kv_heads != self.n_heads)
        out = out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)
        if self.output_gate:  # Qwen3-Next's gated attention
            out = out * gate.reshape(b, s, -1).sigmoid()
        return self.wo(out)


def _gqa_modules(args, at: Placement) -> dict[str, nn.Module]:
    return {"attn": Attention(args, window=args.window(at.layer))}


def _gqa_apply(block: nn.Module, x_BSD: torch.Tensor, docs: DocumentMask | None) -> torch.Tensor:
    return block.attn(x_BSD, docs)


GQA = AttentionKind("gqa", _gqa_modules, _gqa_apply, hf_names={
    **{f"attn.w{x}.{p}": f"self_attn.{x}_proj.{p}" for x in "qkvo" for p in ("weight", "bias")},
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight", "attn.sinks": "self_attn.sinks"})
"""Grouped-query softmax attention at ``layers.N.attn``."""
