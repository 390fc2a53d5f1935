"""Mixtral (``model_type: mixtral``): softmax routing renormalised over the top-k, GQA, no
QK-norm, no biases, no shared expert; experts ``block_sparse_moe.experts.{e}.w1|w3|w2``."""

from __future__ import annotations

from moezero.checkpoint.hf.arch import Arch, check_common, heads, positive, refuse, rope_theta
from moezero.checkpoint.hf.family import Family, sliding, token_ids


def read(cfg: dict, where: str) -> Arch:
    check_common(cfg, where)
    vocab, dim, ffn, layers, n_heads, experts, top_k = positive(
        cfg, where, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_local_experts", "num_experts_per_tok")
    kv, head_dim = heads(cfg, where, n_heads, dim)
    window = sliding(cfg, "sliding_window")
    if window:
        raise refuse(where, *window, "moezero's attention is full causal")
    if cfg.get("router_jitter_noise", 0.0) not in (0, 0.0, None):
        raise refuse(where, "router_jitter_noise", cfg["router_jitter_noise"],
                     "moezero has no router jitter")
    if cfg.get("attention_bias"):
        raise refuse(where, "attention_bias", cfg["attention_bias"],
                     "Mixtral's projections have no bias")
    return Arch(vocab, dim, layers, n_heads, ffn, rope_theta(cfg, where, 1e6),
                float(cfg.get("rms_norm_eps", 1e-5)), experts, top_k, kv, head_dim,
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def write(arch: Arch) -> dict:
    return {"intermediate_size": arch.ffn_dim, "num_local_experts": arch.num_experts,
            "max_position_embeddings": 4096 * 32, "sliding_window": None,
            "router_jitter_noise": 0.0, **token_ids(arch, bos_token_id=1, eos_token_id=2)}


def refusal(arch: Arch):
    if arch.qk_norm != "none":
        return "model.qk_norm", arch.qk_norm, "Mixtral has no QK-norm"
    if arch.attn_bias != "none":
        return "model.attn_bias", arch.attn_bias, "Mixtral's projections have no bias"
    if not arch.renormalize:
        return "moe.renormalize", False, "Mixtral always renormalises the top-k gates"
    if arch.shared_ffn_dim:
        return "moe.shared_ffn_dim", arch.shared_ffn_dim, "Mixtral has no shared expert"
    return None


FAMILY = Family("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"),
                read, write, refusal)
