"""The Hugging Face MoE families moezero reads and writes, and how one is chosen: by
``config.json``'s ``model_type`` on import, by the architecture on export."""

from __future__ import annotations

import dataclasses
import json

from moezero.checkpoint.hf import (
    deepseek_v3,
    glm4_moe,
    gpt_oss,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from moezero.checkpoint.hf.arch import Arch, refuse
from moezero.checkpoint.hf.family import Family
from moezero.plan.store import CheckpointError

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    mixtral.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY, olmoe.FAMILY, gpt_oss.FAMILY,
    qwen3_next.FAMILY)}
FAMILIES.update({f.model_type: f for f in (  # DeepSeek-style routing
    glm4_moe.FAMILY, deepseek_v3.FAMILY)})
FAMILIES[qwen3_5_moe.FAMILY.model_type] = qwen3_5_moe.FAMILY  # Qwen3-Next's decoder, nested


def family_of_config(cfg: dict, where: str) -> Family:
    """The family of a ``config.json`` object, by ``model_type``; CheckpointError naming it."""
    family = FAMILIES.get(cfg.get("model_type"))
    if family is None:
        raise refuse(where, "model_type", cfg.get("model_type"),
                     f"moezero imports {', '.join(FAMILIES)}")
    return family


def family_for(arch: Arch, model_type: str | None = None) -> Family:
    """The family that holds ``arch`` (``model_type``: that one, or chosen by the router, QK-norm
    and the shared expert); CheckpointError (one line) naming the moezero key it cannot hold."""
    if model_type is None and arch.attn_sinks:
        model_type = "gpt_oss"
    if model_type is None and arch.router_scoring == "sigmoid" and arch.expert_bias:
        model_type = _deepseek_style(arch)
    if model_type is None and (arch.gated_delta_layers or arch.attn_output_gate):
        model_type = "qwen3_next"
    if model_type is None:
        model_type = {"head": "qwen3_moe", "projection": "olmoe"}.get(
            arch.qk_norm, "qwen2_moe" if arch.shared_ffn_dim else "mixtral")
    if model_type not in FAMILIES:
        raise CheckpointError(f"no Hugging Face family {model_type!r} (known: "
                              f"{', '.join(FAMILIES)})")
    family = FAMILIES[model_type]
    if family is gpt_oss.FAMILY:
        why = family.refusal(arch) or _layer_refusal(arch, family)
    else:
        why = (_common_refusal(_without(arch, family.holds), family)
               or gpt_oss.foreign_refusal(_without(arch, family.holds)) or family.refusal(arch))
    if why:
        key, value, reason = why
        raise CheckpointError(f"{key}={json.dumps(value)} cannot be exported as Hugging Face "
                              f"{model_type}: {reason}")
    return family


def _deepseek_style(arch: Arch) -> str:
    """A sigmoid router with an expert bias is DeepSeek-V3's noaux_tc: its own family with
    latent attention, else GLM-4.5 (grouped-query attention)."""
    return "deepseek_v3" if arch.attention == "mla" else "glm4_moe"


def _without(arch: Arch, holds: frozenset[str]) -> Arch:
    """``arch`` with the fields a family ``holds`` at their defaults, so the common refusal
    leaves them to the family's own."""
    defaults = {f.name: f.default for f in dataclasses.fields(Arch)}
    return dataclasses.replace(arch, **{k: defaults[k] for k in holds if k in defaults})


def _common_refusal(arch: Arch, family: Family):
    if arch.router_scoring != "softmax":
        return ("moe.router_scoring", arch.router_scoring,
                "the exported families route with a softmax")
    if arch.expert_bias:
        return "moe.expert_bias", True, "the exported families have no expert bias"
    return _layer_refusal(arch, family)


def _layer_refusal(arch: Arch, family: Family):
    """What only some families hold: group-limited routing and scaled gates, partial rotary,
    dense first layers, latent attention, Qwen3-Next's hybrid layers."""
    if arch.n_group != 1 or arch.routed_scaling_factor != 1:
        key, value = (("moe.n_group", arch.n_group) if arch.n_group != 1 else
                      ("moe.routed_scaling_factor", arch.routed_scaling_factor))
        return key, value, "the exported families route over every expert, gates unscaled"
    if arch.partial_rotary_factor != 1 and not family.hybrid:
        return ("model.partial_rotary_factor", arch.partial_rotary_factor,
                "the exported families rotate every dim of a head")
    if arch.first_k_dense:
        return ("model.first_k_dense", arch.first_k_dense,
                "the exported families have an MoE layer in every layer")
    if arch.attention != "gqa":
        return ("model.attention", arch.attention,
                "the exported families have grouped-query attention")
    return None if family.hybrid else _hybrid_refusal(arch)


def _hybrid_refusal(arch: Arch):
    """Qwen3-Next's layer options, which only its family holds."""
    if arch.gated_delta_layers:
        return ("model.gated_delta_layers", list(arch.gated_delta_layers),
                "only qwen3_next has gated DeltaNet layers")
    if arch.attn_output_gate:
        return ("model.attn_output_gate", True, "only qwen3_next gates the attention output")
    return None
