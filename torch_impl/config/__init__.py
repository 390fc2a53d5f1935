"""Typed, validated run configuration: YAML/JSON files plus ``--set key=value``.

Sections mirror DeepSpeed's names where the concept is the same
(``zero_optimization.stage``, ``offload_optimizer.device``, ``nvme_path``,
``gradient_clipping``, the fp16 loss-scale knobs). Every bad input becomes a
:class:`ConfigError` whose message is one line naming the dotted key, e.g.
``zero_optimization.stagee: unknown key (run.yaml)``.

``schema`` holds the sections (pydantic models; the model's, ``model`` and ``moe``, in
``model``), ``loader`` reading, overriding and dumping,
``errors`` the error types; everything public is re-exported here. This is the lowest layer
of the torch side: it imports pydantic, yaml, the standard library and the plan's rules
(pure Python), never torch. The plan receives plain values taken from it, never these models.
"""

from __future__ import annotations

from moezero.config.errors import ConfigError
from moezero.config.loader import DEFAULT_RECIPE, dump_config, load_config, parse_override, to_yaml
from moezero.config.model import ARCHITECTURE, ARCHITECTURE_KEYS, ModelConfig, MoEConfig
from moezero.config.offload import OffloadConfig, OptimizerOffloadConfig, ParamOffloadConfig
from moezero.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DistConfig,
    OptimizerConfig,
    PrecisionConfig,
    TokenizerConfig,
    TrainConfig,
    ZeroConfig,
)

__all__ = [
    "ARCHITECTURE", "ARCHITECTURE_KEYS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DistConfig", "ModelConfig",
    "MoEConfig", "OffloadConfig", "OptimizerConfig", "OptimizerOffloadConfig", "ParamOffloadConfig", "PrecisionConfig",
    "TokenizerConfig", "TrainConfig", "ZeroConfig", "DEFAULT_RECIPE", "dump_config", "load_config", "parse_override", "to_yaml",
]
