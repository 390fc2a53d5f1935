"""Qwen3-Next (``model_type: qwen3_next``): a hybrid of gated DeltaNet layers
(``linear_attention``) and softmax attention with a sigmoid output gate, QK-norm per head and
partial rotary (``full_attention``), chosen per layer by ``layer_types``; every layer's MLP an
MoE layer with a sigmoid-gated shared expert. Its RMSNorms weigh by ``1 + weight``
(zero-centred gains): import reads them as ``1 + w`` (``source``), export writes ``g - 1``
(``export_items``), and imports default to fp32 (``Family.import_dtype``), which holds
``1 + w`` exactly where bf16 would round it; the gated DeltaNet's own output norm weighs by
its weight and is copied as is.

Refused in one line: ``mlp_only_layers`` / ``decoder_sparse_step`` other than every layer an
MoE layer, and multi-token-prediction weights (``mtp.*``, ``mtp_num_hidden_layers``), which
moezero does not train and does not carry.
"""

from __future__ import annotations

import re

from moezero.checkpoint.hf.arch import Arch, check_common, moe_sizes, positive, refuse, topk_arch
from moezero.checkpoint.hf.family import Family
from moezero.checkpoint.hf.names import candidates, hf_name, locate
from moezero.checkpoint.hf.qwen import EXPERT_NAMES, qwen_keys
from moezero.checkpoint.hf.reader import Derived

KINDS = ("linear_attention", "full_attention")
_LINEAR = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
           "linear_value_head_dim", "linear_conv_kernel_dim")
GAIN = re.compile(r"norm\.weight|layers\.\d+\.(attn_norm|ffn_norm|attn\.[qk]_norm)\.weight")
"""The RMSNorm gains that weigh by ``1 + weight`` (not the gated DeltaNet's output norm)."""
HOLDS = frozenset({"partial_rotary_factor", "gated_delta_layers", "attn_output_gate"})
"""The architecture features (``families.FEATURES``) Qwen3-Next and Qwen3.5-MoE hold."""


def _check(cfg: dict, where: str) -> None:
    check_common(cfg, where)
    if cfg.get("mlp_only_layers"):
        raise refuse(where, "mlp_only_layers", cfg["mlp_only_layers"],
                     "moezero reads every Qwen3-Next layer as an MoE layer")
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise refuse(where, "decoder_sparse_step", cfg["decoder_sparse_step"],
                     "moezero reads every Qwen3-Next layer as an MoE layer")
    if cfg.get("mtp_num_hidden_layers"):
        raise refuse(where, "mtp_num_hidden_layers", cfg["mtp_num_hidden_layers"],
                     "multi-token-prediction weights are neither trained nor carried")


def _layer_types(cfg: dict, where: str, n_layers: int) -> tuple[int, ...]:
    """The layers of kind ``linear_attention`` (transformers' default: all but every 4th)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        step = cfg.get("full_attention_interval", 4)
        kinds = [KINDS[(i + 1) % step == 0] for i in range(n_layers)]
    if len(kinds) != n_layers or set(kinds) - set(KINDS):
        raise refuse(where, "layer_types", kinds,
                     f"must list {n_layers} layers, each one of {', '.join(KINDS)}")
    return tuple(i for i, kind in enumerate(kinds) if kind == KINDS[0])


def _rope(cfg: dict) -> tuple[dict, float]:
    """(the config with ``partial_rotary_factor`` taken out of ``rope_parameters``, it)."""
    params = dict(cfg.get("rope_parameters") or {})
    factor = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return {**cfg, "rope_parameters": params}, float(factor)


def read(cfg: dict, where: str) -> Arch:
    _check(cfg, where)
    cfg, factor = _rope(cfg)
    s = moe_sizes(cfg, where, "moe_intermediate_size", "shared_expert_intermediate_size")
    linear = dict(zip(_LINEAR, positive(cfg, where, *_LINEAR), strict=True))
    if linear["linear_num_value_heads"] % linear["linear_num_key_heads"]:
        raise refuse(where, "linear_num_value_heads", linear["linear_num_value_heads"],
                     "must be a multiple of linear_num_key_heads")
    return topk_arch(cfg, where, s, 1e-6, qk_norm="head", shared_ffn_dim=s.ffn[1],
                     shared_gate=True, attn_bias="all" if cfg.get("attention_bias") else "none",
                     partial_rotary_factor=factor, attn_output_gate=True,
                     gated_delta_layers=_layer_types(cfg, where, s.layers), **linear)


def write(arch: Arch) -> dict:
    kinds = [KINDS[i not in arch.gated_delta_layers] for i in range(arch.n_layers)]
    return {"intermediate_size": arch.shared_ffn_dim,
            "shared_expert_intermediate_size": arch.shared_ffn_dim,
            "attention_bias": arch.attn_bias == "all", **qwen_keys(arch),
            "layer_types": kinds, "partial_rotary_factor": arch.partial_rotary_factor,
            "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta,
                                "partial_rotary_factor": arch.partial_rotary_factor},
            **{key: getattr(arch, key) for key in _LINEAR}}


def refusal(arch: Arch):
    if arch.qk_norm != "head":
        return "model.qk_norm", arch.qk_norm, "Qwen3-Next normalises q and k per head"
    if not arch.attn_output_gate:
        return "model.attn_output_gate", False, "Qwen3-Next's attention always has the gate"
    if arch.attn_bias == "qkv":
        return "model.attn_bias", "qkv", "Qwen3-Next biases all four projections or none"
    if not arch.shared_ffn_dim or not arch.shared_gate:
        return ("moe.shared_gate", arch.shared_gate,
                "Qwen3-Next always has a shared expert with a sigmoid gate")
    return None


def gain_source(fqn: str, found: tuple[str, tuple], shape: tuple, tensors):
    """``found`` (key, index), or for an RMSNorm gain a ``Derived`` that reads ``1 + w`` (its
    shape checked here, as the importer checks only a (key, index) source's)."""
    if not GAIN.fullmatch(fqn):
        return found
    key, index = found
    tensors.check_shape(key, index, shape)
    return Derived((key,), lambda t: t.read_rows(key, index, slice(0, shape[0])) + 1.0)


def gain_export(fqn: str):
    """What export writes for ``fqn``: the FQN itself, or for an RMSNorm gain ``g`` a composer
    of ``g - 1`` (``tools.write_weights``)."""
    if not GAIN.fullmatch(fqn):
        return fqn

    def parts(read):
        yield read(fqn) - 1.0
    return parts


def source(fqn: str, shape: tuple, arch: Arch, tensors, where):
    """An RMSNorm gain read as ``1 + w``; None (the names table) for every other tensor."""
    if not GAIN.fullmatch(fqn):
        return None
    return gain_source(fqn, locate(fqn, candidates(fqn, arch, FAMILY), tensors.files, where),
                       shape, tensors)


def export_items(shapes, arch: Arch) -> list[tuple]:
    """Every tensor under its names-table key; the RMSNorm gains written as ``g - 1``."""
    return [(hf_name(fqn, FAMILY), gain_export(fqn), shape) for fqn, shape in shapes]


FAMILY = Family("qwen3_next", "Qwen3NextForCausalLM", "mlp", EXPERT_NAMES, read, write, refusal,
                source=source, export_items=export_items, holds=HOLDS, import_dtype="fp32")
