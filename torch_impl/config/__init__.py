"""Typed, validated run configuration: YAML/JSON files plus ``--set key=value``.

Sections mirror DeepSpeed's names where the concept is the same
(``zero_optimization.stage``, ``offload_optimizer.device``, ``nvme_path``,
``gradient_clipping``, the fp16 loss-scale knobs). Every bad input becomes a
:class:`ConfigError` whose message is one line naming the dotted key, e.g.
``zero_optimization.stagee: unknown key (run.yaml)``.

This module imports only pydantic, yaml and the standard library; the lowest
layer of ``torch_impl`` (see STYLE.md). The plan in ``reference/plan`` receives
plain values taken from it, never the model objects.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DistConfig", "ModelConfig",
    "MoEConfig", "OffloadConfig", "OptimizerConfig", "PrecisionConfig", "TrainConfig",
    "ZeroConfig", "DEFAULT_RECIPE", "dump_config", "load_config", "parse_override", "to_yaml",
]

DEFAULT_RECIPE = Path(__file__).parent.parent / "recipes" / "default.yaml"
"""The shipped recipe; equal to ``Config()``."""


class ConfigError(ValueError):
    """A bad config input, as one line: ``<dotted.key>: <what is wrong> (<where>)``.

    ``where`` is a file path, ``--set KEY=VALUE``, or ``defaults``. When one input has
    several problems, the first is in ``key``/``problem``/``where`` and the others follow
    on the same line, joined by ``"; "`` in the same form.
    """

    def __init__(self, key: str, problem: str, where: str, more: Sequence[str] = ()):
        self.key, self.problem, self.where = key, _one_line(problem), _one_line(where)
        self.more = tuple(more)
        line = "; ".join([f"{key}: {self.problem} ({self.where})", *self.more])
        super().__init__(_one_line(line))

    def __reduce__(self):  # picklable across spawned ranks
        return type(self), (self.key, self.problem, self.where, self.more)


class _FieldError(ValueError):
    """Raised inside model validators to name the offending field (relative dotted path)."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}")


class _Section(BaseModel):
    """Base of every section: unknown keys rejected, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def __setattr__(self, name: str, value: Any) -> None:
        # pydantic keeps a value that failed an after-validator on assignment; undo it.
        old = self.__dict__.get(name, _MISSING)
        try:
            super().__setattr__(name, value)
        except ValidationError:
            if old is not _MISSING:
                self.__dict__[name] = old
            raise


_MISSING = object()


# --------------------------------------------------------------------------- sections


class TrainConfig(_Section):
    """The training loop."""

    steps: int = Field(300, ge=1, description="Optimizer steps to run (total, including resumed ones).")
    seed: int = Field(0, ge=0, description="Seed for parameter init, routing noise and data order.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per rank per micro-batch.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches averaged per optimizer step.")
    seq_len: int = Field(128, ge=1, description="Tokens per sequence.")
    log_every: int = Field(10, ge=1, description="Print progress every this many steps.")
    out_dir: str | None = Field(None, description="Run directory; None lets the CLI pick one (--out sets it).")


class ModelConfig(_Section):
    """Mixtral-style decoder: RMSNorm, RoPE attention, SwiGLU experts."""

    vocab_size: int = Field(256, ge=2, description="Token vocabulary (256 = bytes).")
    dim: int = Field(128, ge=1, description="Residual stream width.")
    n_layers: int = Field(4, ge=1, description="Decoder blocks, each with one MoE layer.")
    n_heads: int = Field(4, ge=1, description="Attention heads; must divide dim with an even head dim.")
    ffn_dim: int = Field(256, ge=1, description="Hidden width of each SwiGLU expert.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init.")
    # Options of the Hugging Face families (docs/model.md, docs/hf.md).
    n_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads (grouped-query attention); must divide "
                                "n_heads; None = n_heads.")
    head_dim: int | None = Field(
        None, ge=2, description="Dims per head (even, RoPE); None = dim / n_heads.")
    qk_norm: Literal["none", "head", "projection"] = Field(
        "none", description="RMSNorm on q and k: per head (Qwen3-MoE) or over the whole "
                            "projection (OLMoE).")
    attn_bias: Literal["none", "qkv", "all"] = Field(
        "none", description="Biases on the q/k/v projections (Qwen2-MoE), or on those and the "
                            "output projection.")

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.head_dim is None and self.dim % self.n_heads:
            raise _FieldError("dim", f"must be divisible by model.n_heads ({self.n_heads}), got {self.dim}")
        head = self.head_dim or self.dim // self.n_heads
        if head % 2:
            raise _FieldError("head_dim" if self.head_dim else "dim",
                              f"head dim {head} must be even (RoPE)")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise _FieldError("n_kv_heads", f"must divide model.n_heads ({self.n_heads}), "
                                            f"got {self.n_kv_heads}")
        return self


class MoEConfig(_Section):
    """Mixture-of-Experts layers: routing, expert parallelism and optimizer grouping."""

    num_experts: int = Field(8, ge=1, description="Experts per MoE layer (E).")
    top_k: int = Field(2, ge=1, description="Experts each token is routed to.")
    ep_size: int = Field(2, ge=1, description="Expert-parallel size: ranks one layer's experts are spread over.")
    capacity_factor: float | None = Field(
        None, gt=0, description="Expert capacity = factor * tokens * top_k / E; None = dropless.")
    expert_group_name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]+$",
        description="Name of the expert parameter group (used in optimizer-group names); "
                    "None = 'ep_size_{ep_size}'. See `group_name`.")
    max_group_size: int | None = Field(
        None, gt=0, description="Hard cap on elements per optimizer group (tiled step); None = no cap.")
    split_groups_by_expert: bool = Field(True, description="One optimizer group per (layer, expert).")
    aux_loss_coef: float = Field(0.01, ge=0, description="Weight of the load-balancing aux loss.")
    z_loss_coef: float = Field(0.001, ge=0, description="Weight of the router z-loss.")
    # Router variants and shared experts (docs/model.md "Router", "Shared experts").
    router_scoring: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="Router scores: softmax over experts, or a sigmoid per expert.")
    renormalize: bool = Field(True, description="Renormalise the top-k gates to sum 1 (Mixtral); "
                                                "false: the raw scores (OLMoE, Qwen2-MoE).")
    expert_bias: bool = Field(False, description="Aux-loss-free balancing (DeepSeek-V3): a "
                                                 "per-expert bias on the scores for the top-k "
                                                 "choice, updated outside the optimizer.")
    bias_update_rate: float = Field(1e-3, ge=0, description="Expert bias step per optimizer "
                                                            "step: bias += rate * sign(mean "
                                                            "load - load).")
    shared_ffn_dim: int = Field(0, ge=0, description="Hidden width of the always-on shared "
                                                     "SwiGLU expert; 0 = none.")
    shared_gate: bool = Field(False, description="Scale the shared expert by sigmoid(x . g) "
                                                 "per token (Qwen2-MoE).")

    @property
    def group_name(self) -> str:
        """The resolved expert group name: ``expert_group_name`` or ``ep_size_{ep_size}``."""
        return self.expert_group_name or f"ep_size_{self.ep_size}"

    @model_validator(mode="after")
    def _routing(self) -> MoEConfig:
        if self.top_k > self.num_experts:
            raise _FieldError("top_k", f"must be <= moe.num_experts ({self.num_experts}), got {self.top_k}")
        if self.num_experts % self.ep_size:
            raise _FieldError(
                "ep_size", f"must divide moe.num_experts ({self.num_experts}), got {self.ep_size}")
        if self.shared_gate and not self.shared_ffn_dim:
            raise _FieldError("shared_gate", "needs a shared expert (moe.shared_ffn_dim > 0)")
        return self


class PrecisionConfig(_Section):
    """Compute dtype and fp16 dynamic loss scaling (DeepSpeed's ``fp16`` block)."""

    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Compute dtype; auto = bf16 on GPUs that support it, else fp32.")
    initial_scale_power: int = Field(16, ge=0, le=64, description="fp16: initial loss scale is 2**this.")
    loss_scale_window: int = Field(1000, ge=1, description="fp16: overflow-free steps before doubling.")
    hysteresis: int = Field(2, ge=1, description="fp16: overflows tolerated before halving the scale.")
    min_loss_scale: float = Field(1.0, gt=0, description="fp16: the scale never drops below this.")

    def resolve(self, *, cuda: bool, bf16_supported: bool) -> Literal["fp32", "bf16", "fp16"]:
        """The concrete dtype for a device (``auto`` never reaches the engine)."""
        if self.dtype != "auto":
            return self.dtype
        return "bf16" if cuda and bf16_supported else "fp32"

    @model_validator(mode="after")
    def _scale(self) -> PrecisionConfig:
        if self.min_loss_scale > 2.0**self.initial_scale_power:
            raise _FieldError("min_loss_scale", f"must be <= 2**initial_scale_power, got {self.min_loss_scale}")
        return self


class OptimizerConfig(_Section):
    """AdamW with linear warmup then cosine decay."""

    type: Literal["adamw"] = Field("adamw", description="Optimizer; only AdamW for now.")
    lr: float = Field(3e-3, ge=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam (beta1, beta2), each in [0, 1).")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay.")
    no_decay_on_norms: bool = Field(True, description="No weight decay on norm gains and biases.")
    expert_lr: float | None = Field(None, ge=0, description="Peak lr of expert params; None = lr.")
    router_lr: float | None = Field(None, ge=0, description="Peak lr of router params; None = lr.")
    gradient_clipping: float | None = Field(
        1.0, ge=0, description="Clip the global grad norm to this; 0 or None disables.")
    warmup_steps: int = Field(30, ge=0, description="Linear warmup steps from 0 to lr.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay ends at lr * this.")

    @property
    def max_grad_norm(self) -> float | None:
        """``gradient_clipping`` with 0 normalised to None (no clipping)."""
        return self.gradient_clipping or None

    @model_validator(mode="after")
    def _betas(self) -> OptimizerConfig:
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise _FieldError(f"betas.{i}", f"must be in [0, 1), got {beta}")
        return self


class OffloadConfig(_Section):
    """Where a ZeRO state lives (DeepSpeed's ``offload_optimizer`` / ``offload_param``)."""

    device: Literal["none", "cpu", "nvme"] = Field("none", description="none = accelerator memory.")
    nvme_path: str | None = Field(None, description="Folder for swap files; required for nvme.")

    @model_validator(mode="after")
    def _nvme(self) -> OffloadConfig:
        if self.device == "nvme" and not self.nvme_path:
            raise _FieldError("nvme_path", "required when device is 'nvme'")
        return self


class ZeroConfig(_Section):
    """ZeRO sharding (DeepSpeed's ``zero_optimization`` block)."""

    stage: int = Field(2, ge=0, le=3, description="0 = plain DP, 1 = shard optimizer state, "
                                                  "2 = + gradients, 3 = + parameters.")
    tiled_step: bool = Field(True, description="Step one optimizer group at a time (bounded fp32 peak).")
    reduce_bucket_size: int = Field(int(5e7), ge=1, description="Elements per gradient-reduction bucket.")
    overlap_comm: bool = Field(True, description="Overlap gradient reduction with backward.")
    offload_optimizer: OffloadConfig = Field(
        default_factory=OffloadConfig, description="Optimizer state offload (stage >= 1).")
    offload_param: OffloadConfig = Field(
        default_factory=OffloadConfig, description="Parameter offload (stage 3 only).")

    @model_validator(mode="after")
    def _offload(self) -> ZeroConfig:
        if self.offload_optimizer.device != "none" and self.stage < 1:
            raise _FieldError("offload_optimizer.device",
                              f"offloading the optimizer needs zero_optimization.stage >= 1, got {self.stage}")
        if self.offload_param.device != "none" and self.stage != 3:
            raise _FieldError("offload_param.device",
                              f"offloading params needs zero_optimization.stage 3, got {self.stage}")
        return self


class CheckpointConfig(_Section):
    """Saving and resuming."""

    model_config = ConfigDict(populate_by_name=True)

    every: int = Field(0, ge=0, description="Save every this many steps; 0 = only at the end.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints to keep; older ones are deleted.")
    load: str | None = Field(None, min_length=1, description="Resume from a step directory, or 'latest'.")
    async_save: bool = Field(False, alias="async", description="Write in the background (key: async).")
    dir: str | None = Field(None, description="Checkpoint root; None = <run dir>/checkpoints.")

    def resolve_dir(self, run_dir: str | os.PathLike) -> Path:
        """The checkpoint root for a run directory."""
        return Path(self.dir) if self.dir else Path(run_dir) / "checkpoints"


class DataConfig(_Section):
    """Training data: a byte-level text file or the built-in synthetic corpus."""

    path: str | None = Field(None, description="Text file (byte-level); None = synthetic corpus.")
    synthetic_vocab: int = Field(32, ge=2, description="Synthetic corpus: token alphabet size.")
    synthetic_sources: int = Field(4, ge=1, description="Synthetic corpus: seeded Markov sources mixed.")
    synthetic_seed: int = Field(1234, ge=0, description="Synthetic corpus: seed of the sources.")


class DistConfig(_Section):
    """torch.distributed."""

    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto = nccl on CUDA, else gloo.")
    timeout_s: float = Field(300.0, gt=0, description="Collective timeout in seconds.")

    def resolve_backend(self, *, cuda: bool) -> Literal["gloo", "nccl"]:
        """The concrete backend for a device."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if cuda else "gloo"


class Config(_Section):
    """A whole run. ``Config()`` is the embedded default recipe."""

    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Decoder architecture.")
    moe: MoEConfig = Field(default_factory=MoEConfig, description="MoE layers.")
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig, description="Mixed precision.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer + schedule.")
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO sharding/offload.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training data.")
    dist: DistConfig = Field(default_factory=DistConfig, description="torch.distributed.")

    @model_validator(mode="after")
    def _across_sections(self) -> Config:
        if self.data.path is None and self.data.synthetic_vocab > self.model.vocab_size:
            raise _FieldError("data.synthetic_vocab",
                              f"must be <= model.vocab_size ({self.model.vocab_size}), "
                              f"got {self.data.synthetic_vocab}")
        if self.data.path is not None and self.model.vocab_size < 256:
            raise _FieldError("model.vocab_size",
                              f"byte-level data.path needs >= 256, got {self.model.vocab_size}")
        return self


# --------------------------------------------------------------------------- loading


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` / ``5e7`` as floats (YAML 1.2), not strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_override(text: str) -> tuple[list[str], object]:
    """Parse ``a.b.c=value`` into ``(["a", "b", "c"], value)``; the value is read as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(key or "--set", "expected KEY=VALUE (no '=')", f"--set {text}")
    path = key.split(".")
    if not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part) for part in path):
        raise ConfigError(key or "--set", "bad key: expected dotted names like a.b.c", f"--set {text}")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(key, f"value is not valid YAML: {_first_line(e)}", f"--set {text}") from None
    return path, value


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the file at ``path`` (YAML, or JSON by suffix), then ``--set`` overrides.

    Raises:
        ConfigError: on any bad input, with a one-line message naming the dotted key.
    """
    data: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}
    if path is not None:
        data = _canonical_tree(Config, _read_file(path), (), os.fspath(path))
        for leaf in _leaves(data):
            sources[leaf] = os.fspath(path)
    for text in overrides:
        keys, value = parse_override(text)
        where = f"--set {text}"
        keys, model = _canonical_keys(keys, where)
        if model is not None and isinstance(value, dict):
            value = _canonical_tree(model, value, tuple(keys), where)
        _set_path(data, keys, value, where)
        for leaf in _leaves(value, tuple(keys)):
            sources[leaf] = where
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise _convert(e, sources) from None


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML, with the keys users write (``checkpoint.async``)."""
    return yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)


def dump_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML; ``load_config(path)`` gives back an equal config."""
    Path(path).write_text(to_yaml(cfg))


def _read_file(path: str | os.PathLike) -> dict[str, Any]:
    where = os.fspath(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError("config", "file not found", where) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("config", f"cannot read file: {_first_line(e)}", where) from None
    try:
        if Path(path).suffix.lower() == ".json":
            data = json.loads(text)
        else:
            data = yaml.load(text, Loader=_Loader)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError("config", f"not valid {_kind(path)}: {_first_line(e)}", where) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"top level must be a mapping, got {type(data).__name__}", where)
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(str(bad[0]), "keys must be strings", where)
    return data


def _field(model: type[BaseModel] | None, key: str) -> FieldInfo | None:
    """A model's field by name or by alias."""
    if model is None:
        return None
    fields = model.model_fields
    return fields.get(key) or next((f for f in fields.values() if f.alias == key), None)


def _sub_model(model: type[BaseModel] | None, key: str) -> type[BaseModel] | None:
    field = _field(model, key)
    ann = field.annotation if field else None
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _alias(model: type[BaseModel] | None, key: str) -> str:
    field = _field(model, key)
    return field.alias if field and field.alias else key


def _canonical_keys(keys: list[str], where: str) -> tuple[list[str], type[BaseModel] | None]:
    """Field names to the keys users write (``async_save`` -> ``async``); the model at the end."""
    model: type[BaseModel] | None = Config
    is_value = False
    for i, key in enumerate(keys):
        if model is None:  # keys[i-1] was unknown (pydantic reports it) or a value:
            if is_value:
                raise ConfigError(".".join(keys[:i]), "is a value, not a section", where)
            return keys, None
        is_value = _field(model, key) is not None and _sub_model(model, key) is None
        keys = [*keys[:i], _alias(model, key), *keys[i + 1:]]
        model = _sub_model(model, key)
    return keys, model


def _canonical_tree(model: type[BaseModel], data: dict, prefix: tuple[str, ...], where: str) -> dict:
    out: dict[str, Any] = {}
    for key, value in data.items():
        canon = _alias(model, key)
        if canon in out:
            raise ConfigError(".".join((*prefix, canon)), f"given twice (also as '{key}')", where)
        sub = _sub_model(model, key)
        if sub is not None and isinstance(value, dict):
            value = _canonical_tree(sub, value, (*prefix, canon), where)
        out[canon] = value
    return out


def _set_path(data: dict[str, Any], keys: list[str], value: object, where: str) -> None:
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ConfigError(".".join(keys[: i + 1]), "is not a section, cannot set keys under it", where)
        node = child
    last = keys[-1]
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        _deep_merge(node[last], value)
    else:
        node[last] = value


def _deep_merge(dst: dict[str, Any], src: Mapping[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _deep_merge(dst[key], value)
        else:
            dst[key] = value


def _leaves(value: object, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, (*prefix, str(k)))]
    return [prefix]


def _convert(exc: ValidationError, sources: dict[tuple[str, ...], str]) -> ConfigError:
    """A pydantic ValidationError as one ConfigError (first error named; the rest joined)."""
    parts = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        problem = err["msg"]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, _FieldError):
            loc, problem = (*loc, *cause.field.split(".")), cause.problem
        elif err["type"] == "extra_forbidden":
            problem = "unknown key" + _suggest(loc)
        elif not isinstance(err.get("input"), dict | list):
            problem = f"{problem}, got {_short(err.get('input'))}"
        parts.append((loc, problem))
    (loc0, problem0), rest = parts[0], parts[1:]
    more = [f"{'.'.join(loc) or 'config'}: {problem} ({_where(loc, sources)})"
            for loc, problem in rest[:2]]
    if len(rest) > 2:
        more.append(f"and {len(rest) - 2} more")
    return ConfigError(".".join(loc0) or "config", problem0, _where(loc0, sources), more)


def _where(loc: tuple[str, ...], sources: dict[tuple[str, ...], str]) -> str:
    """Which input set ``loc`` (or, if it was left at its default, its nearest set sibling)."""
    for n in range(len(loc), -1, -1):
        hits = [src for key, src in sources.items() if key[:n] == loc[:n] or key == loc[:len(key)]]
        if hits:
            return ", ".join(dict.fromkeys(reversed(hits)))
    return "defaults"


def _suggest(loc: tuple[str, ...]) -> str:
    model: type[BaseModel] | None = Config
    for part in loc[:-1]:
        model = _sub_model(model, part)
    if model is None:
        return ""
    names = [f.alias or n for n, f in model.model_fields.items()]
    close = difflib.get_close_matches(loc[-1], names, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _kind(path: str | os.PathLike) -> str:
    return "JSON" if Path(path).suffix.lower() == ".json" else "YAML"


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(exc: BaseException) -> str:
    return _one_line(str(exc))


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
