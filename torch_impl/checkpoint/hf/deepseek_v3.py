"""DeepSeek-V3 / R1, Kimi-K2 and Moonlight (``model_type: deepseek_v3``): multi-head latent
attention (``model.attention: mla``, ``moezero.model.mla``: ``q_lora_rank`` set or null,
``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
``rope_interleave``; ``attention_bias`` on ``q_a_proj``, ``kv_a_proj_with_mqa`` and
``o_proj``), and the MoE layers it shares with GLM-4.5 (``deepseek``). Its FP8 block-scaled
weights are dequantized at import (``fp8``). YaRN RoPE (``rope_type: yarn``) is refused for
now, as every family's scaled RoPE (``arch.rope_theta``)."""

from __future__ import annotations

import dataclasses

from moezero.checkpoint.hf.arch import Arch, check_common, positive, refuse, rope_theta
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

MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def read(cfg: dict, where: str) -> Arch:
    if "attention" not in {f.name for f in dataclasses.fields(Arch)}:  # before MLA is merged
        raise refuse(where, "model_type", "deepseek_v3", "multi-head latent attention (MLA) "
                                                         "is not built in this moezero")
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
    return Arch(vocab, dim, layers, n_heads, ffn, rope_theta(cfg, where, 1e4),
                float(cfg.get("rms_norm_eps", 1e-6)), experts, top_k, n_heads, mla[2],
                attn_bias="all" if cfg.get("attention_bias") else "none",
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention="mla", q_lora_rank=q_rank, **dict(zip(MLA_KEYS, mla, strict=True)),
                rope_interleave=bool(cfg.get("rope_interleave", True)),
                **routing(cfg, where, ffn, layers))


def write(arch: Arch) -> dict:
    """The MLA and MoE keys; ``head_dim`` is the rotary width, as transformers sets it."""
    return {"q_lora_rank": arch.q_lora_rank, "kv_lora_rank": arch.kv_lora_rank,
            "qk_nope_head_dim": arch.qk_nope_head_dim, "qk_rope_head_dim": arch.qk_rope_head_dim,
            "v_head_dim": arch.v_head_dim, "rope_interleave": arch.rope_interleave,
            "head_dim": arch.qk_rope_head_dim, "attention_bias": arch.attn_bias == "all",
            "num_key_value_heads": arch.n_heads, "max_position_embeddings": 4096,
            **write_routing(arch), **token_ids(arch, bos_token_id=0, eos_token_id=1)}


def refusal(arch: Arch):
    attention = getattr(arch, "attention", "gqa")  # the field comes with MLA
    if attention != "mla":
        return "model.attention", attention, "DeepSeek-V3 has multi-head latent attention"
    if arch.mla_mscale != 1:
        return ("model.mla_mscale", arch.mla_mscale,
                "YaRN RoPE is not exported yet (moezero's RoPE is unscaled)")
    return routing_refusal(arch, "DeepSeek-V3")


FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", "mlp", EXPERT_NAMES, read, write,
                refusal, shared_block=SHARED_BLOCK, holds=HOLDS | {"attention"},
                dropped=dropped_mtp, peft_as_parameters=EXPERT_NAMES)
