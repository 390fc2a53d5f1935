"""What DeepSeek-V3 (``deepseek_v3``: Kimi-K2, Moonlight) and GLM-4.5 (``glm4_moe``) share: the
noaux_tc router (sigmoid scores, the ``e_score_correction_bias`` added for the choice only,
group-limited top-k over ``n_group`` groups, ``routed_scaling_factor`` on the gates,
``norm_topk_prob``), ``n_shared_experts`` ungated shared experts of ``moe_intermediate_size``
each, dense SwiGLU MLPs of ``intermediate_size`` in the first ``first_k_dense_replace`` layers,
and multi-token-prediction layers moezero drops at import (docs/hf.md, "The
mapping").
"""

from __future__ import annotations

import re

from moezero.checkpoint.hf.arch import Arch, positive, refuse

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
SHARED_BLOCK = "shared_experts"
HOLDS = frozenset({"router_scoring", "expert_bias", "first_k_dense", "n_group",
                   "routed_scaling_factor"})
"""The architecture features (``families.FEATURES``) both families hold (``Family.holds``)."""


def check_router(cfg: dict, where: str) -> None:
    """Refuse the keys of the hub's original configs that name another router or layout."""
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                      ("moe_layer_freq", 1)):
        if key in cfg and cfg[key] != want:
            raise refuse(where, key, cfg[key], f"moezero routes DeepSeek-V3-style models as "
                                               f"{key}={want}")


def routing(cfg: dict, where: str, ffn: int, layers: int) -> dict:
    """The ``Arch`` fields of the router, the shared experts and the dense first layers."""
    check_router(cfg, where)
    (shared,) = positive(cfg, where, "n_shared_experts")
    dense = cfg.get("first_k_dense_replace", 1) or 0
    if not isinstance(dense, int) or not 0 <= dense < layers:
        raise refuse(where, "first_k_dense_replace", dense,
                     f"moezero needs 0 <= it < num_hidden_layers={layers} (one MoE layer)")
    (intermediate,) = positive(cfg, where, "intermediate_size")
    return {"router_scoring": "sigmoid", "expert_bias": True,
            "renormalize": bool(cfg.get("norm_topk_prob", True)),
            "n_group": cfg.get("n_group") or 1, "topk_group": cfg.get("topk_group") or 1,
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
            "shared_ffn_dim": shared * ffn, "first_k_dense": dense,
            "dense_ffn_dim": intermediate}


def write_routing(arch: Arch) -> dict:
    """The exported keys of the router, the shared experts and the dense first layers."""
    return {"moe_intermediate_size": arch.ffn_dim, "n_routed_experts": arch.num_experts,
            "n_shared_experts": arch.shared_ffn_dim // arch.ffn_dim,
            "intermediate_size": arch.dense_ffn_dim or arch.ffn_dim,
            "first_k_dense_replace": arch.first_k_dense, "norm_topk_prob": arch.renormalize,
            "n_group": arch.n_group, "topk_group": arch.topk_group,
            "routed_scaling_factor": arch.routed_scaling_factor,
            "num_nextn_predict_layers": 0}


def routing_refusal(arch: Arch, name: str):
    """What the two families' MoE layers cannot hold: another router, no expert bias, a gated
    shared expert or one that is not a whole number of experts wide."""
    if arch.router_scoring != "sigmoid":
        return "moe.router_scoring", arch.router_scoring, f"{name} routes with sigmoid scores"
    if not arch.expert_bias:
        return "moe.expert_bias", False, f"{name} always has e_score_correction_bias"
    if arch.shared_gate:
        return "moe.shared_gate", True, f"{name}'s shared experts are ungated"
    if not arch.shared_ffn_dim or arch.shared_ffn_dim % arch.ffn_dim:
        return ("moe.shared_ffn_dim", arch.shared_ffn_dim,
                f"{name} has n_shared_experts >= 1 of model.ffn_dim={arch.ffn_dim} each")
    return None


def dropped_mtp(cfg: dict) -> tuple[re.Pattern, str] | None:
    """The multi-token-prediction layers (``num_nextn_predict_layers`` n: layers L..L+n-1 on
    disk, L = ``num_hidden_layers``) as (the pattern of their keys, the note the import
    prints), or None. They serve speculative decoding only; transformers does not load them
    either, and moezero's decoder has no such layer, so the import drops them."""
    extra = cfg.get("num_nextn_predict_layers") or 0
    if not isinstance(extra, int) or extra < 1:
        return None
    first = cfg.get("num_hidden_layers", 0)
    layers = "|".join(str(first + i) for i in range(extra))
    return (re.compile(rf"model\.layers\.({layers})\..*"),
            f"note: dropped the {extra} multi-token-prediction layer(s) "
            f"(num_nextn_predict_layers={extra}, model.layers.{first}+): moezero trains the "
            "decoder only, and the export writes num_nextn_predict_layers: 0")
