"""Qwen3.5-MoE (``model_type: qwen3_5_moe``, ``Qwen3_5MoeForConditionalGeneration``): its
language model is Qwen3-Next's decoder (``qwen3_next``) under ``model.language_model.*``, read
from the nested ``text_config``; the vision tower (``model.visual.*``), its config and the
multi-token-prediction weights (``mtp.*``) are carried through unchanged (``carried``).

What differs from Qwen3-Next on disk: the gated DeltaNet stores ``in_proj_qkv`` [2GK + HV, D]
(all q heads, all k heads, all v heads), ``in_proj_z`` [HV, D], ``in_proj_b`` and
``in_proj_a`` [H, D] apart, where moezero keeps Qwen3-Next's fused ``in_proj_qkvz`` and
``in_proj_ba`` (per key head its q, k, v, z rows; its b, a rows): import gathers the rows
into that order, export (and a PEFT export's B rows) splits them back. A row permutation, so
logits, gradients and AdamW steps are the same numbers. The router always renormalises the
top-k gates (no ``norm_topk_prob``). Its rotary is multi-axis (``mrope_section``,
``mrope_interleaved``): each frequency takes its angle from the temporal, height or width
position; text positions are equal on all three axes, so every frequency gets the plain
position's angle and the rotary is exactly moezero's (partial) RoPE. moezero trains text only.
Legend: G key heads, H value heads, K key dim, V value dim, D model dim.
"""

from __future__ import annotations

import re

import torch

from moezero.checkpoint.hf import qwen3_next
from moezero.checkpoint.hf.arch import Arch, refuse
from moezero.checkpoint.hf.family import Family
from moezero.checkpoint.hf.names import candidates, hf_name, locate
from moezero.checkpoint.hf.qwen import EXPERT_NAMES
from moezero.checkpoint.hf.reader import Derived
from moezero.plan.store import CheckpointError

_FUSED = re.compile(r"layers\.(\d+)\.linear_attn\.(in_proj_qkvz|in_proj_ba)\.weight")
_SPLIT = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}
_IGNORED = ("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "norm_topk_prob",
            "mlp_only_layers", "decoder_sparse_step")
"""text_config keys transformers' Qwen3.5-MoE ignores (the MTP layers are carried)."""
_TEXT_ONLY = ("architectures", "model_type", "dtype", "torch_dtype")


def read(cfg: dict, where: str) -> Arch:
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise refuse(where, "text_config", text, "Qwen3.5-MoE's language model config "
                                                 "must be an object")
    params = {k: v for k, v in (text.get("rope_parameters") or {}).items()
              if k not in ("mrope_section", "mrope_interleaved")}
    inner = {k: v for k, v in text.items() if k not in _IGNORED}
    inner.update(rope_parameters=params, norm_topk_prob=True,
                 tie_word_embeddings=cfg.get("tie_word_embeddings", False))
    return qwen3_next.read(inner, f"{where} text_config")


def write(arch: Arch) -> dict:
    kinds = [qwen3_next.KINDS[i not in arch.gated_delta_layers] for i in range(arch.n_layers)]
    return {"moe_intermediate_size": arch.ffn_dim, "num_experts": arch.num_experts,
            "shared_expert_intermediate_size": arch.shared_ffn_dim,
            "attention_bias": arch.attn_bias == "all", "layer_types": kinds,
            "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta,
                                "partial_rotary_factor": arch.partial_rotary_factor},
            **{key: getattr(arch, key) for key in qwen3_next._LINEAR}}


def refusal(arch: Arch):
    if not arch.renormalize:
        return "moe.renormalize", False, "Qwen3.5-MoE always renormalises the top-k gates"
    return qwen3_next.refusal(arch)


def nest_config(flat: dict, saved: dict) -> dict:
    """The exported ``config.json``: the source's (vision config, token ids, ...) with the
    architecture's keys in its ``text_config`` (its rotary sections kept)."""
    text = dict(saved.get("text_config") or {})
    rope = {**(text.get("rope_parameters") or {}), **flat["rope_parameters"]}
    text.update({k: v for k, v in flat.items() if k not in _TEXT_ONLY}, rope_parameters=rope)
    return {**saved, "architectures": [FAMILY.architecture], "model_type": FAMILY.model_type,
            "text_config": text, "tie_word_embeddings": False,
            "dtype": flat["dtype"], "torch_dtype": flat["torch_dtype"]}


def _hf(key: str) -> str:
    """A text-only family's key under the language model (``model.language_model.``)."""
    return key if key == "lm_head.weight" else "model.language_model." + key.removeprefix("model.")


def _rows(arch: Arch, fused: str) -> torch.Tensor:
    """For each row of moezero's ``fused`` projection, its row in the on-disk parts stacked
    (``[qkv; z]`` or ``[b; a]``)."""
    g, h, k, v = (arch.linear_num_key_heads, arch.linear_num_value_heads,
                  arch.linear_key_head_dim, arch.linear_value_head_dim)
    r = h // g
    if fused == "in_proj_ba":  # per key head: its value heads' b, then their a
        return torch.tensor([j for i in range(g) for j in (*range(i * r, (i + 1) * r),
                                                            *range(h + i * r, h + (i + 1) * r))])
    q0, k0, v0, z0 = 0, g * k, 2 * g * k, 2 * g * k + h * v
    return torch.tensor([j for i in range(g) for j in (
        *range(q0 + i * k, q0 + (i + 1) * k), *range(k0 + i * k, k0 + (i + 1) * k),
        *range(v0 + i * r * v, v0 + (i + 1) * r * v), *range(z0 + i * r * v, z0 + (i + 1) * r * v))])


def _part_rows(arch: Arch, fused: str) -> tuple[int, int]:
    h, hv = arch.linear_num_value_heads, arch.linear_num_value_heads * arch.linear_value_head_dim
    return (2 * arch.linear_num_key_heads * arch.linear_key_head_dim + hv, hv) \
        if fused == "in_proj_qkvz" else (h, h)


def _slices(arch: Arch, fused: str) -> tuple[slice, slice]:
    """The two parts' rows in ``[qkv; z]`` or ``[b; a]``."""
    first, second = _part_rows(arch, fused)
    return slice(0, first), slice(first, first + second)


def source(fqn: str, shape: tuple, arch: Arch, tensors, where):
    """Where ``fqn`` comes from: the gated DeltaNet's fused projections gathered from their
    parts, everything else from the text-only name under ``model.language_model`` (the RMSNorm
    gains read as ``1 + w``, as Qwen3-Next's)."""
    m = _FUSED.fullmatch(fqn)
    if m:
        keys = tuple(f"model.language_model.layers.{m[1]}.linear_attn.{p}.weight"
                     for p in _SPLIT[m[2]])
        for key, rows in zip(keys, _part_rows(arch, m[2]), strict=True):
            if key not in tensors.files:
                raise CheckpointError(f"{where}: no tensor for {fqn} (looked for {key})")
            tensors.check_shape(key, (), (rows, shape[1]))
        perm = _rows(arch, m[2])
        return Derived(keys, lambda t: torch.cat([t.read(k).float() for k in keys])[perm])
    options = [(_hf(k), i) for k, i in candidates(fqn, arch, FAMILY)]
    return qwen3_next.gain_source(fqn, locate(fqn, options, tensors.files, where), shape,
                                  tensors)


def export_items(shapes, arch: Arch) -> list[tuple]:
    """Every tensor under its Qwen3.5-MoE key; the fused DeltaNet projections split, the
    RMSNorm gains written as ``g - 1`` (as Qwen3-Next's)."""
    items = []
    for fqn, shape in shapes:
        m = _FUSED.fullmatch(fqn)
        if m is None:
            items.append((_hf(hf_name(fqn, FAMILY)), qwen3_next.gain_export(fqn), shape))
            continue
        inverse = torch.argsort(_rows(arch, m[2]))
        for part, rows in zip(_SPLIT[m[2]], _slices(arch, m[2]), strict=True):
            items.append((f"model.language_model.layers.{m[1]}.linear_attn.{part}.weight",
                          _composer(fqn, inverse, rows), (rows.stop - rows.start, shape[1])))
    return items


def _composer(fqn: str, inverse: torch.Tensor, rows: slice):
    def parts(read):
        yield read(fqn)[inverse][rows]
    return parts


def peft_keys(tensors: dict, modules: set, arch: Arch) -> tuple[dict, set]:
    """A PEFT adapter as the text-only families name it -> Qwen3.5-MoE's: under
    ``model.language_model``, the fused DeltaNet projections' adapters split into their parts
    (the same A; B's rows as the weight's)."""
    out = {}
    for key, value in tensors.items():
        key = key.replace("base_model.model.model.", "base_model.model.model.language_model.", 1)
        m = re.search(r"\.linear_attn\.(in_proj_qkvz|in_proj_ba)\.lora_([AB])\.weight$", key)
        if m is None:
            out[key] = value
            continue
        full = value if m[2] == "A" else value[torch.argsort(_rows(arch, m[1]))]
        for part, rows in zip(_SPLIT[m[1]], _slices(arch, m[1]), strict=True):
            out[key.replace(m[1], part)] = full.clone() if m[2] == "A" else full[rows].clone()
    for fused, parts in _SPLIT.items():
        if f"linear_attn.{fused}" in modules:
            modules = (modules - {f"linear_attn.{fused}"}) | {f"linear_attn.{p}" for p in parts}
    return out, modules


FAMILY = Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "mlp", EXPERT_NAMES,
                read, write, refusal, source=source, export_items=export_items,
                holds=qwen3_next.HOLDS, import_dtype="fp32", carried=re.compile(r"model\.visual\..*|mtp\..*"),
                nest_config=nest_config, peft_keys=peft_keys)
