"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight): the attention kind ``MLA``
(``moezero.model.kind``), with its Hugging Face names.

Keys and values come from one small latent per token: ``kv_a_proj_with_mqa`` maps x to a
latent c (``kv_lora_rank`` wide) and one rotary key part shared by every head
(``qk_rope_head_dim`` wide); c is RMS-normed (``kv_a_layernorm``) and expanded by
``kv_b_proj`` into each head's non-rotary key part and value. Queries come from x directly
(``q_proj``) or through their own normed latent (``q_a_proj`` -> ``q_a_layernorm`` ->
``q_b_proj``, with ``q_lora_rank`` set). Each head's query and key are [nope | rope]; RoPE
turns the rope parts only, after de-interleaving them with ``rope_interleave`` (DeepSeek's
checkpoints store those dims as pairs). Scores are ``q·k · scale`` with ``scale =
(qk_nope_head_dim + qk_rope_head_dim)^-0.5 · mla_mscale²`` (YaRN's softmax factor; 1 without
it). Exactly as transformers' ``DeepseekV3Attention`` computes it, module names included, so
the Hugging Face names map one to one (tests/torch_impl/test_mla.py).

Semantics are docs/model.md ("Multi-head latent attention"); the JAX counterpart is
``reference/mla.py``. Legend: B batch, S sequence, D model dim, H heads, N non-rotary
(``qk_nope_head_dim``), R rotary (``qk_rope_head_dim``), Q = N + R, V value head dim,
C latent rank (``kv_lora_rank``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moezero.model.attention import RMSNorm, rope
from moezero.model.kind import AttentionKind, Placement
from moezero.model.packing import DocumentMask

LATENT_NORM_EPS = 1e-6
"""Epsilon of the latent RMSNorms: transformers builds them with ``DeepseekV3RMSNorm``'s
default, not the config's ``rms_norm_eps``."""


def mla_projections(q_lora_rank: int | None) -> tuple[str, ...]:
    """The LoRA-adaptable projections of MLA, in parameter order (Hugging Face's names)."""
    q = ("q_proj",) if q_lora_rank is None else ("q_a_proj", "q_b_proj")
    return (*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... laid out as halves [x0, x2, ... | x1, x3, ...], so the
    half-split RoPE turns each pair by one frequency (transformers' interleaved RoPE)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLA(nn.Module):
    """Latent attention of H heads (shapes in the module docstring). Biases on ``q_a_proj``,
    ``kv_a_proj_with_mqa`` and ``o_proj`` with ``attn_bias: all`` (HF ``attention_bias``);
    never on ``q_proj``, ``q_b_proj``, ``kv_b_proj``.

    Args:
        args: the decoder's ``ModelArgs`` (``dim``, ``n_heads``, ``rope_theta``, ``attn_bias``
            and the MLA fields ``q_lora_rank`` .. ``mla_mscale``).
    """

    lora_owner = "attn"  # moezero.model.lora; lora_projections is per instance

    def __init__(self, args):
        super().__init__()
        d, h, bias = args.dim, args.n_heads, args.attn_bias == "all"
        self.n_heads, self.theta, self.interleave = h, args.rope_theta, args.rope_interleave
        self.nope, self.rot, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.rank, qk = args.kv_lora_rank, self.nope + self.rot
        self.scale = qk ** -0.5 * args.mla_mscale ** 2
        self.yarn = args.yarn  # YaRN frequencies and cos/sin factor (DeepSeek-V3, Kimi-K2)
        self.lora_projections = mla_projections(args.q_lora_rank)
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.rot, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=bias)

    def _queries(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x_BSD)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD)))

    def _rope(self, x_BSHR: torch.Tensor, docs: DocumentMask | None) -> torch.Tensor:
        x_BSHR = deinterleave(x_BSHR) if self.interleave else x_BSHR
        return rope(x_BSHR, self.theta, None if docs is None else docs.positions_BS,
                    yarn=self.yarn)

    def forward(self, x_BSD: torch.Tensor, docs: DocumentMask | None = None) -> torch.Tensor:
        """Causal attention over the row, or within each document of ``docs``."""
        b, s, _ = x_BSD.shape
        h = self.n_heads
        q_BSHQ = self._queries(x_BSD).view(b, s, h, self.nope + self.rot)
        q_nope_BSHN, q_rot_BSHR = q_BSHQ.split([self.nope, self.rot], dim=-1)
        c_BSC, k_rot_BSR = self.kv_a_proj_with_mqa(x_BSD).split([self.rank, self.rot], dim=-1)
        kv_BSHX = self.kv_b_proj(self.kv_a_layernorm(c_BSC)).view(b, s, h, self.nope + self.v_dim)
        k_nope_BSHN, v_BSHV = kv_BSHX.split([self.nope, self.v_dim], dim=-1)
        q_rot_BSHR = self._rope(q_rot_BSHR, docs)
        k_rot_BS1R = self._rope(k_rot_BSR[:, :, None, :], docs)  # one rotary key for all heads
        q_BSHQ = torch.cat([q_nope_BSHN, q_rot_BSHR], dim=-1)
        k_BSHQ = torch.cat([k_nope_BSHN, k_rot_BS1R.expand(b, s, h, self.rot)], dim=-1)
        # Zero-padded to one head width, so the fused kernels (flash on CPU and CUDA) take it:
        # with V != Q, SDPA falls back to its math path, which keeps the [B,H,S,S] weights.
        width = max(self.nope + self.rot, self.v_dim)
        q_BHSW, k_BHSW, v_BHSW = (_pad(t, width).transpose(1, 2) for t in (q_BSHQ, k_BSHQ, v_BSHV))
        out_BHSW = F.scaled_dot_product_attention(
            q_BHSW, k_BHSW, v_BHSW, attn_mask=None if docs is None else docs.allowed_B1SS,
            is_causal=docs is None, scale=self.scale)
        out_BSHV = out_BHSW.transpose(1, 2)[..., :self.v_dim]
        return self.o_proj(out_BSHV.reshape(b, s, h * self.v_dim))


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with zeros appended to its last dim up to ``width`` (itself when that wide): a
    zero query/key dim adds nothing to a score, a zero value dim is cut from the output."""
    extra = width - x.shape[-1]
    return F.pad(x, (0, extra)) if extra else x


def _mla_modules(args, at: Placement) -> dict[str, nn.Module]:
    return {"attn": MLA(args)}


def _mla_apply(block: nn.Module, x_BSD: torch.Tensor, docs: DocumentMask | None) -> torch.Tensor:
    return block.attn(x_BSD, docs)


_BIASED = ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")

MLA_KIND = AttentionKind("mla", _mla_modules, _mla_apply, hf_names={
    **{f"attn.{p}.weight": f"self_attn.{p}.weight"
       for p in (*mla_projections(None), *mla_projections(0), "q_a_layernorm", "kv_a_layernorm")},
    **{f"attn.{p}.bias": f"self_attn.{p}.bias" for p in _BIASED}})
"""Multi-head latent attention at ``layers.N.attn``, names as transformers' ``self_attn.*``."""
