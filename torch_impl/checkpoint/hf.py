"""Hugging Face Mixtral checkpoints in and out of moezero (the mapping is docs/hf.md).

``import_hf(src, out)`` reads a local Mixtral directory (``config.json``, safetensors shards,
optionally ``model.safetensors.index.json``) and writes a *weights-only* moezero checkpoint:
the plan's layout (``moezero.plan.layout.plan_layout(..., weights_only=True)``) with fp32
masters keyed by moezero FQNs with global expert ids, no optimizer files, step 0, committed
atomically under ``out/step_00000000/`` with ``out/latest``, and ``out/config.yaml`` (the
default recipe with the imported architecture and ``checkpoint.load: out``). One tensor is in
memory at a time, read as a slice of its file. ``export_hf(ckpt, out)`` writes any moezero
checkpoint as ``config.json`` + safetensors + index that ``MixtralForCausalLM.from_pretrained``
loads. Only JSON and safetensors are read; neither transformers nor a process group is needed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from pydantic import ValidationError
from safetensors import safe_open

from moezero.checkpoint import tokenizer as hf_tokenizer
from moezero.checkpoint.tools import write_weights
from moezero.config import Config, dump_config
from moezero.model.decoder import Decoder, ModelArgs
from moezero.plan import plan_groups, plan_layout, store
from moezero.plan.layout import INDEX_NAME, RangeRecord
from moezero.plan.store import CheckpointError
from moezero.zero.groups import config_user_group, param_specs

__all__ = ["Arch", "arch_from_hf", "export_hf", "hf_config", "hf_name", "import_hf"]

HF_CONFIG = "config.json"
_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_BLOCK = {"attn_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
          "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
          "moe.router.weight": "block_sparse_moe.gate.weight"}
_IN_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"layers\.(\d+)\.moe\.experts\.(\d+)\.(w[123])\.weight")
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")  # a buffer some old checkpoints saved


@dataclass(frozen=True)
class Arch:
    """The architecture both sides agree on, in moezero's names, plus import-only facts."""

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
    tie_embeddings: bool = False

    def sections(self) -> dict:
        """``{"model": {...}, "moe": {...}}`` config values of this architecture."""
        d = asdict(self)
        return {"model": {k: d[k] for k in ("vocab_size", "dim", "n_layers", "n_heads",
                                             "ffn_dim", "rope_theta", "norm_eps")},
                "moe": {"num_experts": self.num_experts, "top_k": self.top_k}}


# ---------------------------------------------------------------- config.json


def _refuse(where: str, key: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: {key}={json.dumps(value)} is not supported: {why}")


def _rope_theta(cfg: dict, where: str) -> float:
    """rope_theta from ``rope_parameters`` (transformers 5) or the top level (4.x)."""
    params = cfg.get("rope_parameters") or {}
    if cfg.get("rope_scaling") not in (None, {}):
        raise _refuse(where, "rope_scaling", cfg["rope_scaling"], "moezero's RoPE is unscaled")
    kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else None
    if kind != "default" or set(params) - {"rope_type", "type", "rope_theta"}:
        raise _refuse(where, "rope_parameters", params, "only the default (unscaled) RoPE")
    return float(params.get("rope_theta", cfg.get("rope_theta", 1e6)))


def _check_features(cfg: dict, where: str, n_heads: int, dim: int) -> None:
    """Refuse what moezero's decoder does not compute (docs/hf.md, "Refused")."""
    head_dim = cfg.get("head_dim")
    if head_dim not in (None, dim // n_heads):
        raise _refuse(where, "head_dim", head_dim, f"moezero's head dim is hidden_size/"
                      f"num_attention_heads = {dim // n_heads}")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise _refuse(where, "hidden_act", cfg["hidden_act"], "experts are SwiGLU (silu)")
    window, positions = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
    if window is not None and (positions is None or window < positions):
        raise _refuse(where, "sliding_window", window, "moezero's attention is full causal")
    for key in ("attention_dropout", "router_jitter_noise"):
        if cfg.get(key, 0.0) not in (0, 0.0, None):
            raise _refuse(where, key, cfg[key], "moezero has no dropout or router jitter")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise _refuse(where, key, cfg[key], "moezero's projections have no bias")


def arch_from_hf(cfg: dict, where: str) -> Arch:
    """Check a Mixtral ``config.json`` object and map it; CheckpointError (one line) naming
    the key and value of the first thing moezero cannot represent."""
    if cfg.get("model_type") != "mixtral":
        raise _refuse(where, "model_type", cfg.get("model_type"), "only 'mixtral' is imported")
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_local_experts", "num_experts_per_tok")
    for key in need:
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise CheckpointError(f"{where}: {key} must be a positive integer, got "
                                  f"{json.dumps(cfg.get(key))}")
    heads, dim = cfg["num_attention_heads"], cfg["hidden_size"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads or dim % heads:
        raise _refuse(where, "num_key_value_heads", kv_heads,
                      f"must divide num_attention_heads={heads}, which must divide hidden_size")
    _check_features(cfg, where, heads, dim)
    return Arch(cfg["vocab_size"], dim, cfg["num_hidden_layers"], heads, cfg["intermediate_size"],
                _rope_theta(cfg, where), float(cfg.get("rms_norm_eps", 1e-5)),
                cfg["num_local_experts"], cfg["num_experts_per_tok"], kv_heads,
                bool(cfg.get("tie_word_embeddings", False)))


def hf_config(arch: Arch, dtype: str) -> dict:
    """``config.json`` of an exported model (full multi-head attention, untied head)."""
    torch_dtype = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "vocab_size": arch.vocab_size, "hidden_size": arch.dim,
            "intermediate_size": arch.ffn_dim, "num_hidden_layers": arch.n_layers,
            "num_attention_heads": arch.n_heads, "num_key_value_heads": arch.n_heads,
            "head_dim": arch.dim // arch.n_heads, "hidden_act": "silu",
            "max_position_embeddings": 4096 * 32, "rms_norm_eps": arch.norm_eps,
            "rope_theta": arch.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta},
            "num_local_experts": arch.num_experts, "num_experts_per_tok": arch.top_k,
            "tie_word_embeddings": False, "sliding_window": None, "attention_dropout": 0.0,
            "router_jitter_noise": 0.0, "output_router_logits": False,
            "bos_token_id": 1, "eos_token_id": 2, "dtype": torch_dtype,
            "torch_dtype": torch_dtype}


# ---------------------------------------------------------------- names


def hf_name(fqn: str) -> str:
    """The Hugging Face key of a moezero FQN, in the per-expert on-disk form that every
    transformers version reads (``block_sparse_moe.experts.{e}.w1``)."""
    if fqn in _TOP:
        return _TOP[fqn]
    expert = _EXPERT.fullmatch(fqn)
    if expert:
        layer, e, w = expert.groups()
        return f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"
    block = _IN_BLOCK.fullmatch(fqn)
    if block and block[2] in _BLOCK:
        return f"model.layers.{block[1]}.{_BLOCK[block[2]]}"
    raise CheckpointError(f"parameter {fqn} has no Hugging Face Mixtral counterpart")


def _candidates(fqn: str, arch: Arch) -> list[tuple[str, tuple]]:
    """(HF key, leading-index slices) that may hold ``fqn``, preferred first: the per-expert
    on-disk form, then transformers 5's fused in-memory form (``mlp.experts.gate_up_proj``
    [E, 2F, D] = gate then up, ``mlp.experts.down_proj`` [E, D, F], ``mlp.gate``)."""
    if fqn == "lm_head.weight" and arch.tie_embeddings:
        return [("model.embed_tokens.weight", ())]
    found = [(hf_name(fqn), ())]
    expert = _EXPERT.fullmatch(fqn)
    if expert:
        layer, e, w = expert[1], int(expert[2]), expert[3]
        fused, f = f"model.layers.{layer}.mlp.experts.", arch.ffn_dim
        found.append({"w1": (fused + "gate_up_proj", (slice(e, e + 1), slice(0, f))),
                      "w3": (fused + "gate_up_proj", (slice(e, e + 1), slice(f, 2 * f))),
                      "w2": (fused + "down_proj", (slice(e, e + 1),))}[w])
    elif fqn.endswith(".moe.router.weight"):
        found.append((hf_name(fqn).replace(".block_sparse_moe.", ".mlp."), ()))
    return found


# ---------------------------------------------------------------- import


class _Tensors:
    """The tensors of a Hugging Face directory: key -> file, read as slices on demand."""

    def __init__(self, root: Path):
        index = root / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: unreadable index: {exc}") from None
            self.files = {k: root / v for k, v in weight_map.items()}
        elif (root / "model.safetensors").is_file():
            with safe_open(root / "model.safetensors", "pt") as f:
                self.files = dict.fromkeys(f.keys(), root / "model.safetensors")
        else:
            raise CheckpointError(f"{root}: no model.safetensors or {INDEX_NAME} (only "
                                  "safetensors weights are read, never pickled .bin files)")

    def _open(self, key: str):
        try:
            return safe_open(self.files[key], "pt")
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.files[key]}: cannot read {key}: {exc}") from None

    def check_shape(self, key: str, index: tuple, shape: tuple[int, ...]) -> None:
        """CheckpointError unless ``key[index]`` (leading dim of a slice dropped) is ``shape``;
        reads the header only."""
        with self._open(key) as f:
            try:
                full = list(f.get_slice(key).get_shape())
            except Exception as exc:  # safetensors raises its own error type
                raise CheckpointError(f"{self.files[key]}: no tensor {key}: {exc}") from None
        got = tuple(len(range(*s.indices(n))) for s, n in zip(index, full, strict=False))
        got = (got + tuple(full[len(index):]))[1:] if index else tuple(full)
        if got != shape:
            raise CheckpointError(f"{self.files[key]}: {key}{_slice_text(index)} has shape "
                                  f"{got}, config.json implies {shape}")

    def read(self, key: str, index: tuple) -> torch.Tensor:
        """``key[index]`` (leading dim of a slice dropped) as fp32."""
        with self._open(key) as f:
            part = f.get_slice(key)
            return (part[index][0] if index else part[:]).float()


def _slice_text(index: tuple) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in index) + "]" if index else ""


def _is_gqa_kv(fqn: str, arch: Arch) -> bool:
    kv = fqn.endswith((".attn.wk.weight", ".attn.wv.weight"))
    return kv and arch.n_kv_heads != arch.n_heads


def _source(tensors: _Tensors, fqn: str, shape: tuple[int, ...], arch: Arch,
            where: Path) -> tuple[str, tuple]:
    """The (HF key, index) holding ``fqn``, its shape checked (headers only)."""
    options = _candidates(fqn, arch)
    key, index = next(((k, i) for k, i in options if k in tensors.files), (None, None))
    if key is None:
        raise CheckpointError(f"{where}: no tensor for {fqn} (looked for "
                              f"{' or '.join(dict.fromkeys(k for k, _ in options))})")
    if _is_gqa_kv(fqn, arch):
        shape = (arch.n_kv_heads * (arch.dim // arch.n_heads), arch.dim)
    tensors.check_shape(key, index, shape)
    return key, index


def _read_param(tensors: _Tensors, fqn: str, source: tuple[str, tuple],
                shape: tuple[int, ...], arch: Arch) -> np.ndarray:
    """The fp32 value of moezero parameter ``fqn``; GQA k/v heads repeated to every head."""
    value = tensors.read(*source)
    if _is_gqa_kv(fqn, arch):  # query head h reads kv head h // (H / kv_heads): repeat_kv
        head = arch.dim // arch.n_heads
        value = value.view(arch.n_kv_heads, head, arch.dim).repeat_interleave(
            arch.n_heads // arch.n_kv_heads, dim=0).reshape(shape)
    return value.contiguous().reshape(-1).numpy()


def read_hf_config(src: Path) -> tuple[Arch, dict]:
    """The checked architecture and the raw ``config.json`` of a Mixtral directory."""
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such directory")
    path = src / HF_CONFIG
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{src}: no {HF_CONFIG} (not a Hugging Face model directory)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable: {' '.join(str(exc).split())}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return arch_from_hf(raw, str(path)), raw


def import_config(arch: Arch, out: Path, where: str, tokenizer: dict | None = None) -> Config:
    """The default recipe with ``arch``, ``checkpoint.load: out`` and the ``tokenizer`` section
    (``out/config.yaml``)."""
    sections = arch.sections()
    ep = 2 if arch.num_experts % 2 == 0 else 1
    data = {**sections, "moe": {**sections["moe"], "ep_size": ep},
            "checkpoint": {"load": str(out.resolve())},
            "data": {"synthetic_vocab": min(32, arch.vocab_size)}, "tokenizer": tokenizer or {}}
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise CheckpointError(f"{where}: maps to {loc}: {err['msg']}") from None


def import_hf(src: str | Path, out: str | Path) -> Path:
    """Write the Mixtral model in ``src`` as a weights-only moezero checkpoint under ``out``.

    Everything is checked (config, tensor names and shapes, from headers) before anything is
    written; the save is the plan's crash-safe ``.partial`` + commit.

    Returns:
        The committed step directory ``out/step_00000000``.

    Raises:
        CheckpointError: (one line) a missing or unsupported input, or ``out`` not empty.
    """
    src, out = Path(src), Path(out)
    arch, raw = read_hf_config(src)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--out {out}: exists and is not an empty directory")
    cfg = import_config(arch, out, str(src / HF_CONFIG), hf_tokenizer.describe_import(src, out))
    tensors = _Tensors(src)
    layout = _layout(arch, cfg)
    sources = {fqn: _source(tensors, fqn, shape, arch, src) for fqn, shape in layout.shapes}
    _check_all_used(tensors, {key for key, _ in sources.values()}, arch, src)
    hf_tokenizer.copy_import(src, out)
    partial = store.begin_save(out, 0)
    records = store.write_headers(layout, partial)
    for f in layout.model_files:
        for t in f.tensors:
            value = _read_param(tensors, t.fqn, sources[t.fqn], layout.shape(t.fqn), arch)
            flat = value[t.start:t.stop]
            crc = store.write_range(partial / f.name, f.data_start + t.begin, flat)
            records.append(RangeRecord(f.name, f.data_start + t.begin, flat.nbytes, crc))
        store.fsync_file(partial / f.name)
    store.write_manifest(
        partial, layout, checksums=records, config=cfg.model_dump(by_alias=True, mode="json"),
        topology={"world_size": 1, "ep_sizes": [cfg.moe.ep_size], "zero_stage": None,
                  "dtype": str(raw.get("dtype") or raw.get("torch_dtype") or "?"),
                  "writer": "import-hf"},
        state={"source": {"format": "hf-mixtral", "path": str(src.resolve()), "config": raw}})
    final = store.commit(partial)
    dump_config(cfg, out / "config.yaml")
    return final


def _layout(arch: Arch, cfg: Config):
    """The plan's layout of the default recipe's groups for this architecture (weights only),
    so a run with the default grouping reads each group contiguously."""
    args = ModelArgs(**arch.sections()["model"], **arch.sections()["moe"],
                     ep_size=cfg.moe.ep_size)
    with torch.device("meta"):
        specs, _ = param_specs(Decoder(args), config_user_group(cfg))
    groups = plan_groups(specs, max_group_size=cfg.moe.max_group_size,
                         split_by_expert=cfg.moe.split_groups_by_expert)
    return plan_layout(groups, {s.fqn: s.shape for s in specs}, step=0, weights_only=True)


def _check_all_used(tensors: _Tensors, used: set[str], arch: Arch, src: Path) -> None:
    """Refuse a tensor moezero would silently drop (a bias, an extra norm, ...)."""
    tied = {"lm_head.weight"} if arch.tie_embeddings else set()
    left = sorted(k for k in set(tensors.files) - used - tied if not _IGNORED.fullmatch(k))
    if left:
        raise CheckpointError(f"{src}: tensor {left[0]} has no place in moezero's decoder "
                              f"({len(left)} such tensors); refusing to drop it")


# ---------------------------------------------------------------- export


def arch_of(manifest) -> Arch:
    """The architecture of a moezero checkpoint: shapes from its layout, the rest (heads,
    RoPE theta, norm eps, top-k) from its config."""
    shapes = dict(manifest.layout.shapes)
    cfg = manifest.config if isinstance(manifest.config, dict) else {}
    flat = {**cfg.get("reference", {}).get("model", {}), **cfg.get("moe", {}), **cfg.get("model", {})}
    for key in ("n_heads", "rope_theta", "norm_eps", "top_k"):
        if key not in flat:
            raise CheckpointError(f"the checkpoint's manifest records no {key}: cannot write "
                                  f"{HF_CONFIG}")
    try:
        vocab, dim = shapes["embed.weight"]
        layers = sum(1 for fqn in shapes if fqn.endswith(".attn_norm.weight"))
        experts = sum(1 for fqn in shapes if fqn.startswith("layers.0.moe.experts.")) // 3
        ffn = shapes["layers.0.moe.experts.0.w1.weight"][0]
    except (KeyError, ValueError):
        raise CheckpointError("the checkpoint is not of moezero's Mixtral decoder "
                              "(no embed.weight or layers.0 experts)") from None
    return Arch(vocab, dim, layers, int(flat["n_heads"]), ffn, float(flat["rope_theta"]),
                float(flat["norm_eps"]), experts, int(flat["top_k"]), int(flat["n_heads"]))


def export_hf(ckpt: Path, out: Path, dtype: str = "fp32",
              shard_bytes: int | None = None) -> list[Path]:
    """``config.json`` + safetensors shards + ``model.safetensors.index.json`` that
    ``MixtralForCausalLM.from_pretrained(out)`` loads; one tensor in memory at a time."""
    manifest = store.read_manifest(ckpt)
    arch = arch_of(manifest)
    tokenizer_files = hf_tokenizer.files_to_export(manifest.config)
    items = [(hf_name(fqn), fqn, shape) for fqn, shape in manifest.layout.shapes]
    files = write_weights(ckpt, manifest, out, items, dtype, shard_bytes=shard_bytes,
                          meta={"format": "pt", "moezero.step": str(manifest.step)})
    config = {**hf_config(arch, dtype), **hf_tokenizer.config_ids(manifest.config)}
    (out / HF_CONFIG).write_text(json.dumps(config, indent=2))
    return [out / HF_CONFIG, *files, *hf_tokenizer.copy_export(tokenizer_files, out)]


def num_params(manifest) -> int:
    """Elements of every parameter of a checkpoint."""
    return sum(math.prod(shape) for _, shape in manifest.layout.shapes)
