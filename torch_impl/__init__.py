"""moezero: Mixture-of-Experts training with ZeRO-sharded data parallelism in PyTorch.

The public surface is re-exported here and imported on first use (PEP 562), so
``python -m moezero.cli`` reports a bad flag before torch is loaded::

    import moezero
    engine = moezero.initialize(model, moezero.load_config("recipe.yaml"))

Subpackages by concern: ``config``, ``distributed``, ``model``, ``zero``, ``offload``,
``checkpoint``; ``engine``, ``train``, ``cli`` and ``data`` on top. ``moezero.plan`` is the
pure (Python + numpy) plan shared with the JAX reference, ``moezero.reference`` (the
``reference`` extra). Nothing here imports JAX.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "initialize": "moezero.engine",
    "Engine": "moezero.engine",
    "load_config": "moezero.config",
    "Config": "moezero.config",
    "ConfigError": "moezero.config",
    "MoE": "moezero.model",
    "SwiGLU": "moezero.model",
    "Decoder": "moezero.model",
    "ModelArgs": "moezero.model",
    "CheckpointError": "moezero.plan.store",
}
_SUBPACKAGES = ("plan", "reference", "config", "distributed", "model", "zero", "offload",
                "checkpoint", "engine", "train", "cli", "data")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"moezero.{name}")
    else:
        raise AttributeError(f"module 'moezero' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBPACKAGES))
