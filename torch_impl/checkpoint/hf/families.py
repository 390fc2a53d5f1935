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
from moezero.config import ARCHITECTURE
from moezero.plan.store import CheckpointError

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    mixtral.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY, olmoe.FAMILY, gpt_oss.FAMILY,
    qwen3_next.FAMILY)}
FAMILIES.update({f.model_type: f for f in (  # DeepSeek-style routing
    glm4_moe.FAMILY, deepseek_v3.FAMILY)})
FAMILIES[qwen3_5_moe.FAMILY.model_type] = qwen3_5_moe.FAMILY  # Qwen3-Next's decoder, nested

_GPT_OSS = "only gpt-oss among the exported families has it"
FEATURES: tuple[tuple[str, str], ...] = (
    ("router_scoring", "the exported families route with a softmax"),
    ("expert_bias", "the exported families have no expert bias"),
    ("n_group", "the exported families route over every expert, gates unscaled"),
    ("routed_scaling_factor", "the exported families route over every expert, gates unscaled"),
    ("partial_rotary_factor", "the exported families rotate every dim of a head"),
    ("first_k_dense", "the exported families have an MoE layer in every layer"),
    ("attention", "the exported families have grouped-query attention"),
    ("gated_delta_layers", "only qwen3_next has gated DeltaNet layers"),
    ("attn_output_gate", "only qwen3_next gates the attention output"),
    ("attn_sinks", _GPT_OSS), ("router_bias", _GPT_OSS), ("expert_mlp_bias", _GPT_OSS),
    ("swiglu_limit", _GPT_OSS), ("sliding_window", _GPT_OSS), ("rope_type", _GPT_OSS))
"""The architecture features only some families hold, in the order they are checked: (``Arch``
field, why a family that does not hold it refuses it). A family lists those it holds in
``Family.holds``; a feature is on when its field is set (one off by default: ``False``, 0,
None, empty) or differs from its default (``router_scoring``, ``n_group``, ...;
``rope_type``: YaRN)."""
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Arch)}
_SECTION = {key: section for section, keys in ARCHITECTURE.items() for key in keys}


def family_of_config(cfg: dict, where: str) -> Family:
    """The family of a ``config.json`` object, by ``model_type``; CheckpointError naming it."""
    family = FAMILIES.get(cfg.get("model_type"))
    if family is None:
        raise refuse(where, "model_type", cfg.get("model_type"),
                     f"moezero imports {', '.join(FAMILIES)}")
    return family


def family_for(arch: Arch, model_type: str | None = None) -> Family:
    """The family that holds ``arch`` (``model_type``: that one, or chosen by the router, QK-norm
    and the shared expert); CheckpointError (one line) naming the moezero key it cannot hold:
    the first of ``FEATURES`` it does not hold, else what its own ``refusal`` names."""
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
    why = unheld(arch, family) or family.refusal(arch)
    if why:
        key, value, reason = why
        raise CheckpointError(f"{key}={json.dumps(value)} cannot be exported as Hugging Face "
                              f"{model_type}: {reason}")
    return family


def _deepseek_style(arch: Arch) -> str:
    """A sigmoid router with an expert bias is DeepSeek-V3's noaux_tc: its own family with
    latent attention, else GLM-4.5 (grouped-query attention)."""
    return "deepseek_v3" if arch.attention == "mla" else "glm4_moe"


def unheld(arch: Arch, family: Family) -> tuple[str, object, str] | None:
    """(moezero key, value, why) of the first of ``FEATURES`` that ``arch`` has and ``family``
    does not hold, or None."""
    for field, why in FEATURES:
        value, default = getattr(arch, field), _DEFAULTS[field]
        on = value != default if default else bool(value)
        if on and field not in family.holds:
            return f"{_SECTION[field]}.{field}", value, why
    return None
