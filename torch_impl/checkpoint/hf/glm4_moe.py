"""GLM-4.5 / 4.6 (``model_type: glm4_moe``): grouped-query attention with q/k/v biases
(``attention_bias``), optional QK-norm per head (``use_qk_norm``), partial rotary
(``partial_rotary_factor``, 0.5 by default, in ``rope_parameters`` or at the top level), and
DeepSeek-V3's MoE layers (``deepseek``: the noaux_tc router, shared experts, dense first layers,
multi-token-prediction layers dropped)."""

from __future__ import annotations

from moezero.checkpoint.hf.arch import Arch, check_common, heads, positive, rope_theta
from moezero.checkpoint.hf.deepseek import (
    EXPERT_NAMES,
    HOLDS,
    SHARED_BLOCK,
    dropped_mtp,
    routing,
    routing_refusal,
    write_routing,
)
from moezero.checkpoint.hf.family import Family

DEFAULT_PARTIAL_ROTARY = 0.5  # transformers' Glm4MoeConfig default


def read(cfg: dict, where: str) -> Arch:
    check_common(cfg, where)
    vocab, dim, ffn, layers, n_heads, experts, top_k = positive(
        cfg, where, "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "n_routed_experts|num_local_experts", "num_experts_per_tok")
    kv, head_dim = heads(cfg, where, n_heads, dim)
    params = dict(cfg.get("rope_parameters") or {})
    factor = params.pop("partial_rotary_factor",
                        cfg.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY))
    theta = rope_theta({**cfg, "rope_parameters": params}, where, 1e4)
    return Arch(vocab, dim, layers, n_heads, ffn, theta, float(cfg.get("rms_norm_eps", 1e-5)),
                experts, top_k, kv, head_dim,
                qk_norm="head" if cfg.get("use_qk_norm") else "none",
                attn_bias="qkv" if cfg.get("attention_bias") else "none",
                partial_rotary_factor=float(factor),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                **routing(cfg, where, ffn, layers))


def write(arch: Arch) -> dict:
    factor = arch.partial_rotary_factor
    return {"attention_bias": arch.attn_bias == "qkv", "use_qk_norm": arch.qk_norm == "head",
            "partial_rotary_factor": factor,
            "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta,
                                "partial_rotary_factor": factor},
            "max_position_embeddings": 131072, **write_routing(arch)}


def refusal(arch: Arch):
    if arch.qk_norm == "projection":
        return "model.qk_norm", "projection", "GLM-4.5 normalises q and k per head"
    if arch.attn_bias == "all":
        return "model.attn_bias", "all", "GLM-4.5's output projection has no bias"
    return routing_refusal(arch, "GLM-4.5")


FAMILY = Family("glm4_moe", "Glm4MoeForCausalLM", "mlp", EXPERT_NAMES, read, write, refusal,
                shared_block=SHARED_BLOCK, holds=HOLDS | {"partial_rotary_factor"},
                dropped=dropped_mtp, peft_as_parameters=EXPERT_NAMES)
