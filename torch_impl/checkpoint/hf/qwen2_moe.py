"""Qwen2-MoE (``model_type: qwen2_moe``): q/k/v biases (``qkv_bias``), a shared expert gated
per token by ``sigmoid(shared_expert_gate · x)``, top-k gates renormalised only with
``norm_topk_prob``."""

from __future__ import annotations

from moezero.checkpoint.hf.arch import Arch, heads, positive, rope_theta
from moezero.checkpoint.hf.family import Family
from moezero.checkpoint.hf.qwen import EXPERT_NAMES, check_layers, dense_layers_off


def read(cfg: dict, where: str) -> Arch:
    check_layers(cfg, where)
    vocab, dim, ffn, shared, layers, n_heads, experts, top_k = positive(
        cfg, where, "vocab_size", "hidden_size", "moe_intermediate_size",
        "shared_expert_intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_experts|num_local_experts", "num_experts_per_tok")
    kv, head_dim = heads(cfg, where, n_heads, dim)
    return Arch(vocab, dim, layers, n_heads, ffn, rope_theta(cfg, where, 1e4),
                float(cfg.get("rms_norm_eps", 1e-6)), experts, top_k, kv, head_dim,
                attn_bias="qkv" if cfg.get("qkv_bias", True) else "none",
                renormalize=bool(cfg.get("norm_topk_prob", False)), shared_ffn_dim=shared,
                shared_gate=True, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def write(arch: Arch) -> dict:
    return {"intermediate_size": arch.shared_ffn_dim, "moe_intermediate_size": arch.ffn_dim,
            "shared_expert_intermediate_size": arch.shared_ffn_dim,
            "num_experts": arch.num_experts, "norm_topk_prob": arch.renormalize,
            "qkv_bias": arch.attn_bias == "qkv", **dense_layers_off()}


def refusal(arch: Arch):
    if arch.qk_norm != "none":
        return "model.qk_norm", arch.qk_norm, "Qwen2-MoE has no QK-norm"
    if arch.attn_bias == "all":
        return "model.attn_bias", "all", "Qwen2-MoE's output projection has no bias"
    if not arch.shared_ffn_dim or not arch.shared_gate:
        return ("moe.shared_gate", arch.shared_gate,
                "Qwen2-MoE always has a shared expert with a sigmoid gate")
    return None


FAMILY = Family("qwen2_moe", "Qwen2MoeForCausalLM", "mlp", EXPERT_NAMES, read, write, refusal)
