"""Qwen2-MoE (``model_type: qwen2_moe``): q/k/v biases (``qkv_bias``), a shared expert gated
per token by ``sigmoid(shared_expert_gate · x)``, top-k gates renormalised only with
``norm_topk_prob``."""

from __future__ import annotations

from moezero.checkpoint.hf.arch import Arch, moe_sizes, topk_arch
from moezero.checkpoint.hf.family import Family
from moezero.checkpoint.hf.qwen import EXPERT_NAMES, check_layers, qwen_keys


def read(cfg: dict, where: str) -> Arch:
    check_layers(cfg, where)
    s = moe_sizes(cfg, where, "moe_intermediate_size", "shared_expert_intermediate_size")
    return topk_arch(cfg, where, s, 1e-6, shared_ffn_dim=s.ffn[1], shared_gate=True,
                     attn_bias="qkv" if cfg.get("qkv_bias", True) else "none")


def write(arch: Arch) -> dict:
    return {"intermediate_size": arch.shared_ffn_dim,
            "shared_expert_intermediate_size": arch.shared_ffn_dim,
            "qkv_bias": arch.attn_bias == "qkv", **qwen_keys(arch)}


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
