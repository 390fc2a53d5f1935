"""gpt-oss (``model_type: gpt_oss``): grouped-query attention with biases on all four
projections and a learned sink per head, sliding-window and full layers alternating
(``layer_types``), YaRN RoPE; a router with a bias whose top-k logits are softmaxed; experts
with biases and the clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``).

The hub's expert layout is read and written as the hub has it: per layer
``mlp.experts.gate_up_proj`` [E, D, 2F] (x @ W; gate and up interleaved along the last dim:
gate = ``[..., 0::2]``, up = ``[..., 1::2]``) with ``gate_up_proj_bias`` [E, 2F] interleaved
the same way, ``down_proj`` [E, F, D] with ``down_proj_bias`` [E, D], ``mlp.router.weight`` /
``.bias``; or, in the quantized hub checkpoints, ``gate_up_proj_blocks``/``_scales`` and
``down_proj_blocks``/``_scales`` in MXFP4 ([E, 2F, D/32, 16] / [E, 2F, D/32]; [E, D, F/32, 16]
/ [E, D, F/32]: the un-transposed weights), dequantized one expert at a time at import
(``checkpoint/hf/mxfp4.py``). Export writes the unquantized fused layout.
"""

from __future__ import annotations

import re

import torch

from moezero.checkpoint.hf import mxfp4
from moezero.checkpoint.hf.arch import Arch, check_common, moe_sizes, refuse
from moezero.checkpoint.hf.family import Family
from moezero.checkpoint.hf.names import hf_name
from moezero.checkpoint.hf.reader import Derived
from moezero.checkpoint.hf.rope import rope_fields, rope_parameters
from moezero.plan.store import CheckpointError

MOE = re.compile(r"layers\.(\d+)\.moe\.(?:experts\.(\d+)\.(w[123])|router)\.(weight|bias)")
"""moezero's router and expert FQNs of a gpt-oss MoE layer: (layer, expert, w, weight|bias)."""
LAYER_TYPES = ("sliding_attention", "full_attention")


def read(cfg: dict, where: str) -> Arch:
    check_common({k: v for k, v in cfg.items() if k != "mlp_bias"}, where)
    s = moe_sizes(cfg, where, "intermediate_size")
    quant = cfg.get("quantization_config")
    if quant and quant.get("quant_method") != "mxfp4":
        raise refuse(where, "quantization_config.quant_method", quant.get("quant_method"),
                     "gpt-oss is read unquantized or in MXFP4")
    types = tuple(cfg.get("layer_types") or
                  (LAYER_TYPES[i % 2] for i in range(s.layers)))
    if len(types) != s.layers or set(types) - set(LAYER_TYPES):
        raise refuse(where, "layer_types", list(types), f"needs {s.layers} entries of "
                                                        f"{', '.join(LAYER_TYPES)}")
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and not (isinstance(window, int) and window >= 1):
        raise refuse(where, "sliding_window", window, "sliding layers need a positive window")
    return Arch(s.vocab, s.dim, s.layers, s.n_heads, s.ffn[0], norm_eps=float(cfg.get(
        "rms_norm_eps", 1e-5)), num_experts=s.experts, top_k=s.top_k, n_kv_heads=s.kv,
        head_dim=s.head_dim, attn_bias="all" if cfg.get("attention_bias", True) else "none",
        attn_sinks=True, sliding_window=window if "sliding_attention" in types else None,
        layer_types=types, router_scoring="topk_softmax", router_bias=True,
        expert_mlp_bias=True, swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **rope_fields(cfg, where, 150000.0))


def write(arch: Arch) -> dict:
    return {"intermediate_size": arch.ffn_dim, "num_local_experts": arch.num_experts,
            "attention_bias": arch.attn_bias == "all", "sliding_window": arch.sliding_window,
            "layer_types": list(arch.layer_types or ("full_attention",) * arch.n_layers),
            "swiglu_limit": arch.swiglu_limit, "swiglu_alpha": arch.swiglu_alpha,
            "rope_parameters": rope_parameters(arch), "max_position_embeddings": 131072,
            "router_aux_loss_coef": 0.0, "initializer_range": 0.02}


def refusal(arch: Arch):
    wants = {"model.attn_sinks": (arch.attn_sinks, True), "moe.router_bias": (arch.router_bias, True),
             "moe.router_scoring": (arch.router_scoring, "topk_softmax"),
             "moe.expert_mlp_bias": (arch.expert_mlp_bias, True),
             "model.qk_norm": (arch.qk_norm, "none"), "moe.shared_ffn_dim": (arch.shared_ffn_dim, 0)}
    for key, (got, want) in wants.items():
        if got != want:
            return key, got, f"gpt-oss has {key.split('.')[1]}={want}"
    if arch.attn_bias == "qkv":
        return "model.attn_bias", "qkv", "gpt-oss biases all four projections or none"
    if arch.swiglu_limit is None:
        return "moe.swiglu_limit", None, "gpt-oss's experts use the clamped SwiGLU"
    return None


def _expect(tensors, key: str, shape: tuple, where) -> None:
    got = tensors.shape(key)
    if got != shape:
        raise CheckpointError(f"{where}: {key} has shape {got}, config.json implies {shape}")


def source(fqn: str, shape: tuple, arch: Arch, tensors, where):
    """Where a router or expert tensor comes from (fused, interleaved, or MXFP4), or None."""
    m = MOE.fullmatch(fqn)
    if m is None:
        return None
    layer, e, w, kind = m.groups()
    p = f"model.layers.{layer}.mlp."
    if e is None:
        return p + f"router.{kind}", ()
    e, n, d, f = int(e), arch.num_experts, arch.dim, arch.ffn_dim
    name = p + ("experts.down_proj" if w == "w2" else "experts.gate_up_proj")
    if kind == "bias":
        if w == "w2":
            return name + "_bias", (slice(e, e + 1),)
        _expect(tensors, name + "_bias", (n, 2 * f), where)
        return Derived((name + "_bias",), lambda t: split_gate_up(
            t.read(name + "_bias", (e,)))[w == "w3"].float())
    if name in tensors.files:
        fused = (n, f, d) if w == "w2" else (n, d, 2 * f)
        _expect(tensors, name, fused, where)
        return Derived((name,), lambda t: fused_weight(t.read(name, (e,)), w))
    if name + "_blocks" not in tensors.files:
        raise CheckpointError(f"{where}: no tensor for {fqn} (looked for {name} and "
                              f"{name}_blocks)")
    rows, cols = (d, f) if w == "w2" else (2 * f, d)
    _expect(tensors, name + "_blocks", (n, rows, cols // mxfp4.BLOCK, mxfp4.BLOCK // 2), where)
    _expect(tensors, name + "_scales", (n, rows, cols // mxfp4.BLOCK), where)
    return Derived((name + "_blocks", name + "_scales"), lambda t: _mxfp4_weight(t, name, e, w))


def split_gate_up(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of a fused, interleaved ``gate_up_proj`` slice or its bias (last dim)."""
    return t[..., 0::2], t[..., 1::2]


def fused_weight(slice_: torch.Tensor, w: str) -> torch.Tensor:
    """moezero's [out, in] ``w`` weight of one expert from the hub's x @ W slice
    (``gate_up_proj[e]`` [D, 2F] for w1/w3, ``down_proj[e]`` [F, D] for w2)."""
    if w == "w2":
        return slice_.float().t().contiguous()
    return split_gate_up(slice_)[w == "w3"].float().t().contiguous()


def _mxfp4_weight(tensors, name: str, e: int, w: str) -> torch.Tensor:
    weight = mxfp4.dequantize(tensors.read(name + "_blocks", (e,)),
                              tensors.read(name + "_scales", (e,)))  # [out(·2), in]
    return weight if w == "w2" else weight[(w == "w3")::2].contiguous()


def export_items(shapes, arch: Arch) -> list[tuple]:
    """Every tensor as the hub has it: the experts fused and interleaved per layer, the
    router under ``mlp.router``, the rest one per FQN."""
    items, done = [], set()
    for fqn, shape in shapes:
        m = MOE.fullmatch(fqn)
        if m is None:
            items.append((hf_name(fqn, FAMILY), fqn, shape))
        elif m[2] is None:
            items.append((f"model.layers.{m[1]}.mlp.router.{m[4]}", fqn, shape))
        elif m[1] not in done:
            done.add(m[1])
            items.extend(_expert_items(int(m[1]), arch))
    return items


def _expert_items(layer: int, arch: Arch) -> list[tuple]:
    n, d, f = arch.num_experts, arch.dim, arch.ffn_dim
    p, q = f"model.layers.{layer}.mlp.experts.", f"layers.{layer}.moe.experts."

    def gate_up(suffix: str):
        def parts(read):
            for e in range(n):
                g, u = read(f"{q}{e}.w1.{suffix}"), read(f"{q}{e}.w3.{suffix}")
                yield torch.stack([g.t(), u.t()] if suffix == "weight" else [g, u], dim=-1)
        return parts

    def down(suffix: str):
        def parts(read):
            for e in range(n):
                t = read(f"{q}{e}.w2.{suffix}")
                yield t.t() if suffix == "weight" else t
        return parts
    return [(p + "gate_up_proj", gate_up("weight"), (n, d, 2 * f)),
            (p + "gate_up_proj_bias", gate_up("bias"), (n, 2 * f)),
            (p + "down_proj", down("weight"), (n, f, d)),
            (p + "down_proj_bias", down("bias"), (n, d))]


FAMILY = Family("gpt_oss", "GptOssForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
                read, write, refusal, source=source, export_items=export_items,
                interleaved_gate_up=True, holds=frozenset({
                    "router_scoring", "attn_sinks", "router_bias", "expert_mlp_bias",
                    "swiglu_limit", "sliding_window", "rope_type"}))
