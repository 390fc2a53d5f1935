"""LoRA adapter checkpoints out to Hugging Face (docs/finetune.md, "Export"):
``--format peft`` (``export_peft``) writes ``adapter_config.json`` +
``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained`` (PEFT >= 0.21) loads on
the ``--format hf`` export of the base; ``--merge-lora --format hf`` (``export_merged``) writes
full weights with ``W + alpha/r · B A`` folded in.

Attention and shared-expert adapters are PEFT ``target_modules`` (``self_attn.q_proj``,
``mlp.shared_expert.gate_proj``, ...), except where PEFT would take a module name for the fused
experts (``Family.peft_as_parameters``: GLM-4.5's and DeepSeek-V3's ``mlp.shared_experts.*`` and
dense ``mlp.*_proj``, which PEFT's transformers-5 conversion retargets to
``mlp.experts.gate_up_proj``): those are ``target_parameters`` ``<module>.weight``, the same
tensors and keys. Routed experts are transformers 5's fused parameters,
PEFT ``target_parameters`` ``mlp.experts.gate_up_proj`` [E, 2F, D] and ``mlp.experts.down_proj``
[E, D, F]: one LoRA per parameter whose ``lora_A`` [E·R, in] stacks the experts' A by rows
(expert-major) and whose ``lora_B`` [out, R·E] holds expert e's column k at ``k·E + e``.
gate_up's adapter of expert e is ``[A1; A3]`` with ``B = diag(B1, B3)``, rank 2r (gpt-oss's
parameters are x @ W, [E, D, 2F] and [E, F, D], which PEFT reads as [experts, in, out]
(transformers marks them ``is_transposed``): the same A and B, with gate_up's B rows
interleaved gate, up as the parameter's columns, ``Family.interleaved_gate_up``): PEFT's
``rank_pattern`` gives that parameter rank 2r and ``alpha_pattern`` ``alpha/r · 2r`` (the same
scale), and every other adapter keeps rank r and ``lora_alpha`` alpha. When both expert
parameters are targeted PEFT nests them: gate_up is ``experts.base_layer``, down_proj is
``experts``. Adapters are small: they are
read whole; the merge holds the base model in memory (fp32).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from moezero.checkpoint import adapter_ckpt
from moezero.checkpoint import tokenizer as hf_tokenizer
from moezero.checkpoint.hf.arch import arch_of
from moezero.checkpoint.hf.carried import attach, checked, hf_section
from moezero.checkpoint.hf.exporter import HF_CONFIG
from moezero.checkpoint.hf.families import family_for
from moezero.checkpoint.hf.names import hf_name
from moezero.plan import store
from moezero.plan.checked import CheckedReader
from moezero.plan.model_buffers import is_buffer
from moezero.plan.reading import read_tensors
from moezero.plan.store import CheckpointError

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_EXPERT = re.compile(r"layers\.(\d+)\.moe\.experts\.(\d+)\.(w[123])\.lora_([AB])")
_FUSED = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}


def _adapter_checkpoint(ckpt: Path, what: str, base: Path | None = None):
    """(manifest, base step dir, trained tensors) of an adapter checkpoint; one-line
    CheckpointError when it holds no adapters or its base is gone or changed. ``base``: where
    the base is now, when it moved (``--base``; checked to be the same base)."""
    manifest = store.read_manifest(ckpt)
    if not manifest.base:
        raise CheckpointError(f"{ckpt}: holds no LoRA adapters (not a peft.method: lora "
                              f"checkpoint); {what} needs them (docs/finetune.md)")
    base_dir = adapter_ckpt.check(manifest.base, ckpt, base)
    trained = {k: torch.from_numpy(v) for k, v in _checked_tensors(ckpt, manifest).items()}
    return manifest, base_dir, trained


def _family(base_manifest, model_type: str | None = None):
    """(architecture, family) of a base checkpoint: the family ``model_type`` names, else the
    one its config records (``hf.model_type``: Qwen3.5-MoE), else the architecture's."""
    arch = arch_of(base_manifest)
    return arch, family_for(arch, model_type or hf_section(base_manifest.config).get("model_type"))


def _checked_tensors(ckpt: Path, manifest) -> dict:
    """Every tensor of ``ckpt``, each byte checked against its manifest (as load does)."""
    return read_tensors(ckpt, manifest, reader=CheckedReader(ckpt, manifest))


def _lora(trained: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{projection FQN prefix: (A, B)} of every adapted projection."""
    return {fqn.removesuffix(".lora_A"): (a, trained[fqn.removesuffix("_A") + "_B"])
            for fqn, a in trained.items() if fqn.endswith(".lora_A")}


def _scale(manifest) -> float:
    peft = manifest.config["peft"]
    return float(peft["alpha"]) / int(peft["r"])


def export_peft(ckpt: Path, out: Path, dtype: str = "fp32", base: Path | None = None
                ) -> list[Path]:
    """``adapter_config.json`` + ``adapter_model.safetensors`` of an adapter checkpoint, for
    the family that holds its architecture (``base``: its base's new place, if it moved)."""
    manifest, base_dir, trained = _adapter_checkpoint(ckpt, "--format peft", base)
    others = sorted(f for f in trained if not f.endswith(adapter_ckpt.ADAPTER_SUFFIXES)
                    and not is_buffer(f))
    _refuse_moved_buffers(ckpt, trained, base_dir)
    if others:
        raise CheckpointError(f"{ckpt}: trains {others[0]} besides the LoRA adapters "
                              f"({len(others)} such tensors); a PEFT adapter holds adapters "
                              "only: export with --merge-lora --format hf")
    arch, family = _family(store.read_manifest(base_dir))
    lora = _lora(trained)
    _refuse_unread(lora, family.model_type, ckpt)
    experts = {k: v for k, v in lora.items() if _EXPERT.fullmatch(k + ".lora_A")}
    fused = sorted({_FUSED[k.rsplit(".", 1)[1]] for k in experts})
    rank = max(a.shape[0] for a, _ in lora.values())
    tensors, modules, params = {}, set(), set()
    for fqn, (a, b) in lora.items():
        if fqn in experts:
            continue
        key = hf_name(fqn + ".weight", family).removesuffix(".weight")
        module = key.split(".", 3)[3]  # model.layers.N.<module>
        if module.endswith(family.peft_as_parameters):
            params.add(module + ".weight")
        else:
            modules.add(module)
        _put(tensors, f"base_model.model.{key}", *_pad(a, b, rank))
    for layer, param, (a, b) in _fused(experts, rank, family.interleaved_gate_up):
        nested = "experts.base_layer" if param == "gate_up_proj" and len(fused) == 2 else "experts"
        _put(tensors, f"base_model.model.model.layers.{layer}.mlp.{nested}", a, b)
    if family.peft_keys:  # the family's own layout (Qwen3.5-MoE)
        tensors, modules = family.peft_keys(tensors, modules, arch)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(DTYPES[dtype]).contiguous() for k, v in tensors.items()},
              out / ADAPTER_WEIGHTS, metadata={"format": "pt", "moezero.step": str(manifest.step)})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
              "lora_alpha": _scale(manifest) * rank, "lora_dropout": 0.0, "bias": "none",
              "use_rslora": False, "fan_in_fan_out": False, "inference_mode": True,
              "target_modules": sorted(modules) or None,
              "target_parameters": [f"mlp.experts.{p}" for p in fused] + sorted(params)
              or None,
              **_fused_rank(fused, rank, _scale(manifest)), "base_model_name_or_path": None}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return [out / ADAPTER_CONFIG, out / ADAPTER_WEIGHTS]


def _refuse_moved_buffers(ckpt: Path, trained: dict, base_dir: Path) -> None:
    """A PEFT adapter holds no buffers: refuse (one line) an adapter checkpoint whose expert
    biases moved away from its base's (``moe.bias_update_rate`` > 0 in the LoRA run)."""
    base_manifest = store.read_manifest(base_dir)
    base = dict(base_manifest.layout.buffers)
    for fqn in sorted(f for f in trained if is_buffer(f)):
        same = fqn in base and torch.equal(trained[fqn], torch.from_numpy(
            store.read_param(base_dir, base_manifest, fqn).reshape(base[fqn])))
        if not same:
            raise CheckpointError(f"{ckpt}: the expert bias {fqn} moved in the LoRA run "
                                  "(moe.bias_update_rate > 0) and a PEFT adapter cannot hold "
                                  "it: export with --merge-lora --format hf, or train with "
                                  "moe.bias_update_rate=0")


_SHARED_MISREAD = ("qwen3_next",)
"""Families whose PEFT config conversion (PEFT's transformers-v5 MoE mapping) takes every
target ending in ``gate_proj``/``up_proj``/``down_proj`` for the routed experts, so a shared
expert's adapters would be silently dropped on load."""


def _refuse_unread(lora: dict, model_type: str, ckpt: Path) -> None:
    shared = sorted(f for f in lora if ".shared." in f)
    if shared and model_type in _SHARED_MISREAD:
        raise CheckpointError(f"{ckpt}: adapts {shared[0]} (a shared expert); PEFT loads "
                              f"{model_type} adapters of gate/up/down_proj as the routed "
                              "experts' and would drop it: export with --merge-lora --format hf")


def _fused_rank(fused: list[str], rank: int, scale: float) -> dict:
    """``rank_pattern`` and ``alpha_pattern``: the fused gate_up adapter has rank 2r (its
    scale stays alpha/r); PEFT matches the key against ``...mlp.experts.gate_up_proj``."""
    if "gate_up_proj" not in fused:
        return {}
    key = r"mlp\.experts\.gate_up_proj"
    return {"rank_pattern": {key: 2 * rank}, "alpha_pattern": {key: scale * 2 * rank}}


def _put(tensors: dict, prefix: str, a: torch.Tensor, b: torch.Tensor) -> None:
    tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b


def _pad(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r, in], B [out, r] zero-padded to rank ``rank`` (the product is unchanged)."""
    extra = rank - a.shape[0]
    return (torch.cat([a, a.new_zeros(extra, a.shape[1])]),
            torch.cat([b, b.new_zeros(b.shape[0], extra)], dim=1))


def _fused(experts: dict, rank: int, interleaved: bool):
    """(layer, fused parameter, (A [E·R, in], B [out, R·E])) of every routed-expert LoRA
    (``interleaved``: gate_up's output rows alternate gate, up, as gpt-oss's parameter)."""
    by_layer: dict[tuple[int, str], dict[int, dict[str, tuple]]] = {}
    for fqn, ab in experts.items():
        layer, e, w, _ = _EXPERT.fullmatch(fqn + ".lora_A").groups()
        by_layer.setdefault((int(layer), _FUSED[w]), {}).setdefault(int(e), {})[w] = ab
    for (layer, param), per_expert in sorted(by_layer.items()):
        pairs = [_expert_pair(per_expert[e], param, rank, interleaved)
                 for e in sorted(per_expert)]
        a = torch.cat([p[0] for p in pairs])
        b = torch.stack([p[1] for p in pairs], dim=-1).flatten(1)
        yield layer, param, (a, b)


def _expert_pair(ws: dict, param: str, rank: int, interleaved: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's A [R, in] and B [out, R]: down_proj's own (R = ``rank``), or gate_up's
    ``[A1; A3]`` and ``diag(B1, B3)`` (R = 2 ``rank``; a projection without adapters
    contributes zeros), B's rows interleaved (gate j at 2j, up j at 2j + 1) when
    ``interleaved``."""
    if param == "down_proj":
        return _pad(*ws["w2"], rank)
    a_ref, b_ref = next(iter(ws.values()))
    r, f = a_ref.shape[0], b_ref.shape[0]
    a, b = a_ref.new_zeros(2 * r, a_ref.shape[1]), b_ref.new_zeros(2 * f, 2 * r)
    for i, w in enumerate(("w1", "w3")):
        if w in ws:
            a[i * r:(i + 1) * r], b[i * f:(i + 1) * f, i * r:(i + 1) * r] = ws[w]
    if interleaved:  # [gate rows; up rows] -> gate 0, up 0, gate 1, up 1, ...
        b = b.reshape(2, f, 2 * r).transpose(0, 1).reshape(2 * f, 2 * r)
    return _pad(a, b, 2 * rank)


def _composed(src, weights: dict, shape: tuple) -> torch.Tensor:
    """An exported tensor: one FQN's, or a family's composition of several (``export_items``)."""
    if not callable(src):
        return weights[src]
    return torch.stack(list(src(weights.__getitem__))).reshape(shape)


def export_merged(ckpt: Path, out: Path, dtype: str = "fp32",
                  model_type: str | None = None, base: Path | None = None) -> list[Path]:
    """The adapter checkpoint's full weights, ``W + alpha/r · B A`` per adapted projection
    (and its other trained params over the base's), as a Hugging Face model directory
    (``base``: its base's new place, if it moved)."""
    manifest, base_dir, trained = _adapter_checkpoint(ckpt, "--merge-lora", base)
    base_manifest = store.read_manifest(base_dir)
    weights = {k: torch.from_numpy(v)
               for k, v in _checked_tensors(base_dir, base_manifest).items()}
    scale = _scale(manifest)
    for fqn, (a, b) in _lora(trained).items():
        weights[fqn + ".weight"] = weights[fqn + ".weight"] + scale * (b @ a)
    weights.update({k: v for k, v in trained.items()
                    if not k.endswith(adapter_ckpt.ADAPTER_SUFFIXES)})
    arch, family = _family(base_manifest, model_type)
    carried = checked(family, base_manifest.config)
    shapes = base_manifest.layout.shapes + base_manifest.layout.buffers
    items = family.export_items(shapes, arch) if family.export_items else \
        [(hf_name(fqn, family), fqn, shape) for fqn, shape in shapes]
    tensors = {key: _composed(src, weights, shape).to(  # biases (buffers) stay fp32
        torch.float32 if isinstance(src, str) and is_buffer(src) else DTYPES[dtype]).contiguous()
               for key, src, shape in items}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors",
              metadata={"format": "pt", "moezero.step": str(manifest.step)})
    config = {**family.config(arch, dtype), **hf_tokenizer.config_ids(manifest.config)}
    config, files = attach(family, carried, config, out, [out / "model.safetensors"])
    (out / HF_CONFIG).write_text(json.dumps(config, indent=2))
    tokenizer_files = hf_tokenizer.files_to_export(manifest.config)
    return [out / HF_CONFIG, *files, *hf_tokenizer.copy_export(tokenizer_files, out)]
