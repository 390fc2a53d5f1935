"""DeepSeek-V3 / R1, Kimi-K2 and Moonlight (``model_type: deepseek_v3``): multi-head latent
attention (``model.attention: mla``, ``moezero.model.mla``: ``q_lora_rank`` set or null,
``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
``rope_interleave``; ``attention_bias`` on ``q_a_proj``, ``kv_a_proj_with_mqa`` and
``o_proj``), and the MoE layers it shares with GLM-4.5 (``deepseek``). Its FP8 block-scaled
weights are dequantized at import (``fp8``). YaRN RoPE (``rope_parameters`` of type ``yarn``,
DeepSeek-V3's and Kimi-K2's) maps to ``model.rope_*`` (``checkpoint/hf/rope.py``), and its
``mscale_all_dim`` to the softmax factor ``model.mla_mscale``, as transformers' attention
computes it."""

from __future__ import annotations

import math

from moezero.checkpoint.hf.arch import Arch, check_common, positive, refuse
from moezero.checkpoint.hf.deepseek import (
    EXPERT_NAMES,
    HOLDS,
    SHARED_BLOCK,
    dropped_mtp,
    routing,
    routing_refusal,
    write_routing,
)
from moezero.checkpoint.hf.family import Family, token_ids
from moezero.checkpoint.hf.rope import rope_fields, rope_parameters

MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def read(cfg: dict, where: str) -> Arch:
    check_common({k: v for k, v in cfg.items() if k not in ("q_lora_rank", "kv_lora_rank")},
                 where)
    vocab, dim, ffn, layers, n_heads, experts, top_k, *mla = positive(
        cfg, where, "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "n_routed_experts|num_local_experts", "num_experts_per_tok",
        *MLA_KEYS)
    if cfg.get("num_key_value_heads") not in (None, n_heads):
        raise refuse(where, "num_key_value_heads", cfg["num_key_value_heads"],
                     f"DeepSeek-V3's latent attention has num_attention_heads={n_heads}")
    q_rank = cfg.get("q_lora_rank")
    if q_rank is not None:
        (q_rank,) = positive(cfg, where, "q_lora_rank")
    rope = rope_fields(cfg, where, 1e4)
    return Arch(vocab, dim, layers, n_heads, ffn, rope.pop("rope_theta"),
                float(cfg.get("rms_norm_eps", 1e-6)), experts, top_k, n_heads, mla[2],
                attn_bias="all" if cfg.get("attention_bias") else "none",
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention="mla", q_lora_rank=q_rank, **dict(zip(MLA_KEYS, mla, strict=True)),
                rope_interleave=bool(cfg.get("rope_interleave", True)),
                mla_mscale=softmax_mscale(rope.get("rope_factor", 1.0),
                                          rope.get("rope_mscale_all_dim")),
                **rope, **routing(cfg, where, ffn, layers))


def softmax_mscale(factor: float, mscale_all_dim: float | None) -> float:
    """transformers' DeepSeek-V3 softmax factor's root: ``0.1·m·ln(factor) + 1`` with YaRN's
    ``mscale_all_dim`` m set and factor > 1, else 1."""
    if not mscale_all_dim or factor <= 1:
        return 1.0
    return 0.1 * mscale_all_dim * math.log(factor) + 1.0


def write(arch: Arch) -> dict:
    """The MLA and MoE keys; ``head_dim`` is the rotary width, as transformers sets it."""
    return {"q_lora_rank": arch.q_lora_rank, "kv_lora_rank": arch.kv_lora_rank,
            "qk_nope_head_dim": arch.qk_nope_head_dim, "qk_rope_head_dim": arch.qk_rope_head_dim,
            "v_head_dim": arch.v_head_dim, "rope_interleave": arch.rope_interleave,
            "head_dim": arch.qk_rope_head_dim, "attention_bias": arch.attn_bias == "all",
            "num_key_value_heads": arch.n_heads, "max_position_embeddings": 4096,
            "rope_parameters": rope_parameters(arch),
            **write_routing(arch), **token_ids(arch, bos_token_id=0, eos_token_id=1)}


def refusal(arch: Arch):
    if arch.attention != "mla":
        return "model.attention", arch.attention, "DeepSeek-V3 has multi-head latent attention"
    want = softmax_mscale(arch.rope_factor, arch.rope_mscale_all_dim) \
        if arch.rope_type == "yarn" else 1.0
    if arch.mla_mscale != want:
        return ("model.mla_mscale", arch.mla_mscale, f"DeepSeek-V3 derives it from the RoPE: "
                                                     f"{want} here")
    return routing_refusal(arch, "DeepSeek-V3")


FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", "mlp", EXPERT_NAMES, read, write,
                refusal, shared_block=SHARED_BLOCK, holds=HOLDS | {"attention", "rope_type"},
                dropped=dropped_mtp, peft_as_parameters=EXPERT_NAMES)
