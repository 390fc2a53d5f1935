"""OLMoE (``model_type: olmoe``): QK-norm over the whole q and k projections (before the head
split), optional biases on all four projections (``attention_bias``), top-k gates
renormalised only with ``norm_topk_prob``; experts ``mlp.experts.{e}.gate_proj|up_proj|
down_proj``."""

from __future__ import annotations

from moezero.checkpoint.hf.arch import Arch, check_common, moe_sizes, refuse, topk_arch
from moezero.checkpoint.hf.family import Family, sliding, token_ids
from moezero.checkpoint.hf.qwen import EXPERT_NAMES


def read(cfg: dict, where: str) -> Arch:
    check_common(cfg, where)
    s = moe_sizes(cfg, where, "intermediate_size")
    if s.head_dim * s.n_heads != s.dim:  # OLMoE's q_norm spans hidden_size
        raise refuse(where, "head_dim", s.head_dim, f"OLMoE needs hidden_size/num_attention_heads "
                                                    f"= {s.dim / s.n_heads}")
    if cfg.get("clip_qkv") is not None:
        raise refuse(where, "clip_qkv", cfg["clip_qkv"], "moezero does not clip q, k, v")
    window = sliding(cfg, "sliding_window")
    if window:
        raise refuse(where, *window, "moezero's attention is full causal")
    return topk_arch(cfg, where, s, 1e-5, qk_norm="projection",
                     attn_bias="all" if cfg.get("attention_bias") else "none")


def write(arch: Arch) -> dict:
    return {"intermediate_size": arch.ffn_dim, "num_experts": arch.num_experts,
            "norm_topk_prob": arch.renormalize, "attention_bias": arch.attn_bias == "all",
            "clip_qkv": None, "max_position_embeddings": 4096,
            **token_ids(arch, pad_token_id=1, eos_token_id=50279)}


def refusal(arch: Arch):
    if arch.qk_norm != "projection":
        return "model.qk_norm", arch.qk_norm, "OLMoE normalises the whole q and k projections"
    if arch.attn_bias == "qkv":
        return "model.attn_bias", "qkv", "OLMoE biases all four projections or none"
    if arch.head_dim * arch.n_heads != arch.dim:
        return "model.head_dim", arch.head_dim, "OLMoE's head dim is hidden_size/heads"
    if arch.shared_ffn_dim:
        return "moe.shared_ffn_dim", arch.shared_ffn_dim, "OLMoE has no shared expert"
    return None


FAMILY = Family("olmoe", "OlmoeForCausalLM", "mlp", EXPERT_NAMES, read, write, refusal)
