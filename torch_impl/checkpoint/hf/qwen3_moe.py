"""Qwen3-MoE (``model_type: qwen3_moe``): QK-norm per head (RMSNorm over each head's dims,
before RoPE), optional biases on all four projections (``attention_bias``), a head dim of its
own (``head_dim``), top-k gates renormalised only with ``norm_topk_prob``."""

from __future__ import annotations

from moezero.checkpoint.hf.arch import Arch, moe_sizes, topk_arch
from moezero.checkpoint.hf.family import Family
from moezero.checkpoint.hf.qwen import EXPERT_NAMES, check_layers, qwen_keys


def read(cfg: dict, where: str) -> Arch:
    check_layers(cfg, where)
    s = moe_sizes(cfg, where, "moe_intermediate_size")
    return topk_arch(cfg, where, s, 1e-6, qk_norm="head",
                     attn_bias="all" if cfg.get("attention_bias") else "none")


def write(arch: Arch) -> dict:
    return {"intermediate_size": arch.ffn_dim, "attention_bias": arch.attn_bias == "all",
            **qwen_keys(arch)}


def refusal(arch: Arch):
    if arch.qk_norm != "head":
        return "model.qk_norm", arch.qk_norm, "Qwen3-MoE normalises q and k per head"
    if arch.attn_bias == "qkv":
        return "model.attn_bias", "qkv", "Qwen3-MoE biases all four projections or none"
    if arch.shared_ffn_dim:
        return "moe.shared_ffn_dim", arch.shared_ffn_dim, "Qwen3-MoE has no shared expert"
    return None


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", EXPERT_NAMES, read, write, refusal)
