"""What Qwen2-MoE and Qwen3-MoE share: every layer an MoE layer (no ``mlp_only_layers``, a
``decoder_sparse_step`` of 1), no sliding window, ``norm_topk_prob`` for the renormalisation,
experts ``mlp.experts.{e}.gate_proj|up_proj|down_proj``."""

from __future__ import annotations

from moezero.checkpoint.hf.arch import Arch, check_common, refuse
from moezero.checkpoint.hf.family import sliding

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def check_layers(cfg: dict, where: str) -> None:
    """Refuse dense layers (moezero's are the first k only, not read from a Qwen config) and
    sliding windows, which moezero's decoder does not build."""
    check_common(cfg, where)
    if cfg.get("mlp_only_layers"):
        raise refuse(where, "mlp_only_layers", cfg["mlp_only_layers"],
                     "moezero reads every Qwen layer as an MoE layer")
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise refuse(where, "decoder_sparse_step", cfg["decoder_sparse_step"],
                     "moezero reads every Qwen layer as an MoE layer")
    window = sliding(cfg)
    if window:
        raise refuse(where, *window, "moezero's attention is full causal")
    kinds = set(cfg.get("layer_types") or ()) - {"full_attention"}
    if kinds:
        raise refuse(where, "layer_types", sorted(kinds), "moezero's attention is full causal")


def qwen_keys(arch: Arch) -> dict:
    """The exported keys both families write: the routed experts' width and number, the top-k
    renormalisation, and every layer an MoE layer with full attention."""
    return {"moe_intermediate_size": arch.ffn_dim, "num_experts": arch.num_experts,
            "norm_topk_prob": arch.renormalize, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "use_sliding_window": False, "sliding_window": None,
            "max_position_embeddings": 32768}
