"""A Hugging Face ``config.json``'s RoPE settings in moezero's names (``model.rope_*``):
``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (4.x), of type
``default`` or ``yarn`` (docs/hf.md); and the same written back as ``rope_parameters``."""

from __future__ import annotations

from moezero.checkpoint.hf.arch import Arch, refuse

YARN_KEYS = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "truncate", "attention_factor", "mscale", "mscale_all_dim"}


def rope_fields(cfg: dict, where: str, default_theta: float) -> dict:
    """``{rope_theta, rope_type, rope_factor, ...}`` of a config; CheckpointError (one line)
    on a RoPE type or key moezero does not build."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", default_theta)))
    if kind == "default" and not params:
        return {"rope_theta": theta}
    extra = set(params) - YARN_KEYS
    if kind != "yarn" or extra or "original_max_position_embeddings" not in params:
        raise refuse(where, "rope_parameters", {"rope_type": kind, **params},
                     "moezero builds the default RoPE and YaRN (with "
                     "original_max_position_embeddings)")
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or cfg["max_position_embeddings"] / original
    return {"rope_theta": theta, "rope_type": "yarn", "rope_factor": float(factor),
            "rope_original_max_positions": int(original),
            "rope_beta_fast": float(params.get("beta_fast") or 32.0),
            "rope_beta_slow": float(params.get("beta_slow") or 1.0),
            "rope_truncate": bool(params.get("truncate", True)),
            "rope_attention_factor": params.get("attention_factor"),
            "rope_mscale": params.get("mscale"), "rope_mscale_all_dim": params.get("mscale_all_dim")}


def rope_parameters(arch: Arch) -> dict:
    """transformers 5's ``rope_parameters`` of ``arch`` (optional YaRN keys only when set)."""
    if arch.rope_type != "yarn":
        return {"rope_type": "default", "rope_theta": arch.rope_theta}
    out = {"rope_type": "yarn", "rope_theta": arch.rope_theta, "factor": arch.rope_factor,
           "original_max_position_embeddings": arch.rope_original_max_positions,
           "beta_fast": arch.rope_beta_fast, "beta_slow": arch.rope_beta_slow,
           "truncate": arch.rope_truncate}
    optional = {"attention_factor": arch.rope_attention_factor, "mscale": arch.rope_mscale,
                "mscale_all_dim": arch.rope_mscale_all_dim}
    return {**out, **{k: v for k, v in optional.items() if v is not None}}
