"""Qwen3-MoE (``model_type: qwen3_moe``): QK-norm per head (RMSNorm over each head's dims,
before RoPE), optional biases on all four projections (``attention_bias``), a head dim of its
own (``head_dim``), top-k gates renormalised only with ``norm_topk_prob``."""

from __future__ import annotations

from moezero.checkpoint.hf.arch import Arch, heads, positive, rope_theta
from moezero.checkpoint.hf.family import Family
from moezero.checkpoint.hf.qwen import EXPERT_NAMES, check_layers, dense_layers_off


def read(cfg: dict, where: str) -> Arch:
    check_layers(cfg, where)
    vocab, dim, ffn, layers, n_heads, experts, top_k = positive(
        cfg, where, "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_experts|num_local_experts", "num_experts_per_tok")
    kv, head_dim = heads(cfg, where, n_heads, dim)
    return Arch(vocab, dim, layers, n_heads, ffn, rope_theta(cfg, where, 1e4),
                float(cfg.get("rms_norm_eps", 1e-6)), experts, top_k, kv, head_dim,
                qk_norm="head", attn_bias="all" if cfg.get("attention_bias") else "none",
                renormalize=bool(cfg.get("norm_topk_prob", False)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def write(arch: Arch) -> dict:
    return {"intermediate_size": arch.ffn_dim, "moe_intermediate_size": arch.ffn_dim,
            "num_experts": arch.num_experts, "norm_topk_prob": arch.renormalize,
            "attention_bias": arch.attn_bias == "all", **dense_layers_off()}


def refusal(arch: Arch):
    if arch.qk_norm != "head":
        return "model.qk_norm", arch.qk_norm, "Qwen3-MoE normalises q and k per head"
    if arch.attn_bias == "qkv":
        return "model.attn_bias", "qkv", "Qwen3-MoE biases all four projections or none"
    if arch.shared_ffn_dim:
        return "moe.shared_ffn_dim", arch.shared_ffn_dim, "Qwen3-MoE has no shared expert"
    return None


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", EXPERT_NAMES, read, write, refusal)
