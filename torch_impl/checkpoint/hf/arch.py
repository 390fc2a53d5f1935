"""The architecture of a Hugging Face MoE model in moezero's names, and the ``config.json``
checks every family shares (docs/hf.md, "Refused").

``Arch`` holds the architecture keys (``moezero.config.ARCHITECTURE``: one field per key, of
the same name; tests/torch_impl/test_model_args.py checks it) that a family's ``config.json``
maps to, plus import-only facts (tied embeddings). ``arch_of(manifest)`` reads the same from a moezero
checkpoint for an export. Every refusal is a one-line ``CheckpointError`` naming the key.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import NamedTuple

from moezero.config import ARCHITECTURE
from moezero.plan.store import CheckpointError

DERIVED_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "rope_theta", "norm_eps",
                "num_experts", "top_k", "n_kv_heads", "head_dim")
"""``Arch``'s first fields, which ``arch_of`` derives (from the checkpoint's shapes, or checked
and resolved from its config); the other architecture keys are copied from the config."""


@dataclass(frozen=True)
class Arch:
    """The architecture both sides agree on, in moezero's names (``head_dim`` resolved)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    rope_theta: float
    norm_eps: float
    num_experts: int
    top_k: int
    n_kv_heads: int
    head_dim: int
    qk_norm: str = "none"
    attn_bias: str = "none"
    renormalize: bool = True
    router_scoring: str = "softmax"
    expert_bias: bool = False
    shared_ffn_dim: int = 0
    shared_gate: bool = False
    first_k_dense: int = 0  # no exported family has dense layers yet (families.py refuses)
    dense_ffn_dim: int | None = None
    partial_rotary_factor: float = 1.0
    # DeepSeek-V3 / GLM-4.5 routing (glm4_moe.py, deepseek_v3.py hold them; the others: 1, 1, 1)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Qwen3-Next's hybrid layers (checkpoint/hf/qwen3_next.py; the other families refuse them)
    gated_delta_layers: tuple[int, ...] = ()
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    attn_output_gate: bool = False
    capacity_factor: float | None = None  # HF is dropless: exported as such (docs/hf.md)
    # gpt-oss (issue 36; checkpoint/hf/gpt_oss.py)
    attn_sinks: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_positions: int | None = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float | None = None
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    router_bias: bool = False
    expert_mlp_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # Multi-head latent attention (model/mla.py); no exported family has it yet (families.py)
    attention: str = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    mla_mscale: float = 1.0
    tie_embeddings: bool = False

    def sections(self) -> dict:
        """``{"model": {...}, "moe": {...}}`` config values (``head_dim`` None when D/H)."""
        d = asdict(self)
        d["head_dim"] = None if self.head_dim * self.n_heads == self.dim else self.head_dim
        return {section: {k: d[k] for k in keys} for section, keys in ARCHITECTURE.items()}


def refuse(where: str, key: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: {key}={json.dumps(value)} is not supported: {why}")


def positive(cfg: dict, where: str, *keys: str) -> list[int]:
    """The values of ``keys`` (the first present of each ``a|b`` alternative), each a positive
    integer, else CheckpointError naming it."""
    out = []
    for spec in keys:
        key = next((k for k in spec.split("|") if k in cfg), spec.split("|")[0])
        if not isinstance(cfg.get(key), int) or isinstance(cfg[key], bool) or cfg[key] < 1:
            raise CheckpointError(f"{where}: {key} must be a positive integer, got "
                                  f"{json.dumps(cfg.get(key))}")
        out.append(cfg[key])
    return out


def rope_theta(cfg: dict, where: str, default: float) -> float:
    """rope_theta from ``rope_parameters`` (transformers 5) or the top level (4.x)."""
    params = cfg.get("rope_parameters") or {}
    if cfg.get("rope_scaling") not in (None, {}):
        raise refuse(where, "rope_scaling", cfg["rope_scaling"], "moezero's RoPE is unscaled")
    kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else None
    if kind != "default" or set(params) - {"rope_type", "type", "rope_theta"}:
        raise refuse(where, "rope_parameters", params, "only the default (unscaled) RoPE")
    return float(params.get("rope_theta", cfg.get("rope_theta", default)))


def check_common(cfg: dict, where: str) -> None:
    """What no family's decoder in moezero computes (docs/hf.md, "Refused")."""
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise refuse(where, "hidden_act", cfg["hidden_act"], "experts are SwiGLU (silu)")
    if cfg.get("attention_dropout", 0.0) not in (0, 0.0, None):
        raise refuse(where, "attention_dropout", cfg["attention_dropout"], "moezero has no dropout")
    if cfg.get("mlp_bias"):
        raise refuse(where, "mlp_bias", cfg["mlp_bias"], "moezero's experts have no bias")
    for key in ("kv_lora_rank", "q_lora_rank"):
        if cfg.get(key) is not None:
            raise refuse(where, key, cfg[key], "multi-head latent attention is DeepSeek-V3's "
                         "(model_type deepseek_v3)")


def heads(cfg: dict, where: str, n_heads: int, dim: int) -> tuple[int, int]:
    """(key/value heads, head dim), checked: kv heads divide the heads; an even head dim."""
    kv = cfg.get("num_key_value_heads") or n_heads
    if not isinstance(kv, int) or n_heads % kv:
        raise refuse(where, "num_key_value_heads", kv, f"must divide num_attention_heads={n_heads}")
    head_dim = cfg.get("head_dim") or dim // n_heads
    if not isinstance(head_dim, int) or head_dim % 2 or (cfg.get("head_dim") is None and dim % n_heads):
        raise refuse(where, "head_dim", cfg.get("head_dim", dim / n_heads),
                     "the head dim must be an even integer (RoPE)")
    return kv, head_dim


class Sizes(NamedTuple):
    """The sizes an MoE family's ``config.json`` gives, checked (``ffn``: the family's own
    FFN size keys, in the order it named them)."""

    vocab: int
    dim: int
    ffn: tuple[int, ...]
    layers: int
    n_heads: int
    experts: int
    top_k: int
    kv: int
    head_dim: int


def moe_sizes(cfg: dict, where: str, *ffn_keys: str) -> Sizes:
    """The sizes of an MoE config with ``num_experts`` (or ``num_local_experts``), each checked
    (``positive``, ``heads``) in the order of the config's usual listing."""
    vocab, dim, *rest = positive(
        cfg, where, "vocab_size", "hidden_size", *ffn_keys, "num_hidden_layers",
        "num_attention_heads", "num_experts|num_local_experts", "num_experts_per_tok")
    *ffn, layers, n_heads, experts, top_k = rest
    kv, head_dim = heads(cfg, where, n_heads, dim)
    return Sizes(vocab, dim, tuple(ffn), layers, n_heads, experts, top_k, kv, head_dim)


def topk_arch(cfg: dict, where: str, s: Sizes, eps: float, **fields) -> Arch:
    """The ``Arch`` of a family that renormalises the top-k gates only with ``norm_topk_prob``
    (Qwen-MoE, OLMoE): the experts' FFN size ``s.ffn[0]``, RoPE theta (1e4 by default),
    ``rms_norm_eps`` (``eps`` by default), tied embeddings; ``fields``: the family's own."""
    return Arch(s.vocab, s.dim, s.layers, s.n_heads, s.ffn[0], rope_theta(cfg, where, 1e4),
                float(cfg.get("rms_norm_eps", eps)), s.experts, s.top_k, s.kv, s.head_dim,
                renormalize=bool(cfg.get("norm_topk_prob", False)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), **fields)


def arch_of(manifest) -> Arch:
    """The architecture of a moezero checkpoint: shapes from its layout, the rest (heads, RoPE
    theta, norm eps, top-k, the options) from its config; CheckpointError (one line) if the
    config records none of them."""
    shapes = dict(manifest.layout.shapes)
    cfg = manifest.config if isinstance(manifest.config, dict) else {}
    flat = {**cfg.get("reference", {}).get("model", {}), **cfg.get("moe", {}),
            **cfg.get("model", {})}
    for key in ("n_heads", "rope_theta", "norm_eps", "top_k"):
        if key not in flat:
            raise CheckpointError(f"the checkpoint's manifest records no {key}: cannot write "
                                  "config.json")
    try:
        vocab, dim = shapes["embed.weight"]
        layers = sum(1 for fqn in shapes if fqn.endswith(".attn_norm.weight"))
        first = f"layers.{int(flat.get('first_k_dense') or 0)}.moe.experts."  # a MoE layer
        experts = len({fqn[len(first):].split(".")[0] for fqn in shapes
                       if fqn.startswith(first)})  # w1, w3, w2, their biases, adapters
        ffn = shapes[f"{first}0.w1.weight"][0]
    except (KeyError, ValueError):
        raise CheckpointError("the checkpoint is not of moezero's decoder "
                              "(no embed.weight or experts in its first MoE layer)") from None
    heads_ = int(flat["n_heads"])
    options = {k: flat[k] for keys in ARCHITECTURE.values() for k in keys
               if k not in DERIVED_KEYS and k in flat}
    return Arch(vocab, dim, layers, heads_, ffn, float(flat["rope_theta"]),
                float(flat["norm_eps"]), experts, int(flat["top_k"]),
                int(flat.get("n_kv_heads") or heads_), int(flat.get("head_dim") or dim // heads_),
                **options)
