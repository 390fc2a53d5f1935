"""Torch model weights ↔ one safetensors file keyed by the FQNs of docs/model.md: the torch
half of the weight-exchange parity test (parity_tests/test_weights.py), test-only (a run saves
and loads through ``moezero.checkpoint``, imports through ``checkpoint.hf``).

JAX counterpart: ``reference/weights.py`` (``save_params`` / ``load_params``); a file written by
either side loads on the other. Only models whose experts are all local (``moe.ep_size`` 1)
are supported: with expert parallelism a rank holds only its own experts, and gathering or
scattering them belongs to checkpointing. Loading never unpickles: safetensors only.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from moezero.model.moe import MoE


def _check_all_experts_local(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, MoE) and module.num_local != module.num_experts:
            raise ValueError(f"{name}: holds {module.num_local} of {module.num_experts} experts "
                             f"(ep_size={module.ep_size}); weights files need ep_size=1")


def save_weights(model: nn.Module, path: str | os.PathLike,
                 dtype: torch.dtype | None = torch.float32,
                 metadata: dict[str, str] | None = None) -> None:
    """Write ``{fqn: tensor}`` of every parameter, cast to ``dtype`` (None keeps each dtype).

    fp32 by default: the reference reads files with numpy, which has no bfloat16.
    """
    _check_all_experts_local(model)
    tensors = {fqn: (p.detach() if dtype is None else p.detach().to(dtype)).cpu().contiguous()
               for fqn, p in model.state_dict().items()}
    save_file(tensors, os.fspath(path), metadata=metadata)


def load_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy a safetensors file into ``model`` by FQN, cast to each parameter's dtype.

    Raises ValueError (one line) naming every missing, unexpected or mis-shaped FQN; the model
    is left untouched then.
    """
    _check_all_experts_local(model)
    flat = load_file(os.fspath(path))
    target = model.state_dict()
    missing, unexpected = target.keys() - flat.keys(), flat.keys() - target.keys()
    bad = [f"{k}: {tuple(flat[k].shape)} != {tuple(v.shape)}" for k, v in target.items()
           if k in flat and flat[k].shape != v.shape]
    if missing or unexpected or bad:
        raise ValueError(f"{os.fspath(path)} does not match the model: missing={sorted(missing)} "
                         f"unexpected={sorted(unexpected)} wrong shapes={bad}")
    with torch.no_grad():
        for fqn, tensor in target.items():
            tensor.copy_(flat[fqn])
