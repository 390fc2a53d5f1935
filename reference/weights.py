"""Params ↔ ``{FQN: np.ndarray}`` ↔ safetensors, keyed by the FQNs of docs/model.md.

Torch counterpart: the ``state_dict()`` of ``torch_impl/model/decoder.py`` (same FQNs; the
expert biases are torch buffers and leaves of the params tree here, ``moezero.plan.model_buffers``).

The reference stacks experts on a leading global expert axis
(``layers[i]["moe"]["experts"]["w1"]["weight"]`` is [E, F, D]); on the exchange side every
expert is its own tensor, named by its global index: ``layers.{i}.moe.experts.{e}.w1.weight``.
Loading never unpickles: safetensors only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from moezero.plan.model_buffers import split_buffers
from moezero.plan.rules import EXPERTS, expert_fqn
from moezero.reference.model import ModelConfig, init_params


def path_keys(path) -> list[str]:
    """A pytree key path as FQN segments: dict keys and list indices."""
    return [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]


def fqn_of(path) -> str:
    """The FQN of a leaf that is one parameter (``layers.0.attn.wq.weight``)."""
    return ".".join(path_keys(path))


def stacked_fqns(path, leaf) -> tuple[str, ...] | None:
    """The FQNs of the experts stacked on ``leaf``'s leading axis, by global index (the plan's
    ``expert_fqn``), or ``None`` for a leaf that is one parameter (``fqn_of``)."""
    keys = path_keys(path)
    if EXPERTS not in keys:
        return None
    i = keys.index(EXPERTS)
    layer, rest = ".".join(keys[:i]), ".".join(keys[i + 1:])
    return tuple(expert_fqn(layer, e, rest) for e in range(leaf.shape[0]))


def to_fqn_dict(params: dict) -> dict[str, np.ndarray]:
    """Flatten params to ``{fqn: np.ndarray}`` (experts unstacked by global index), in order."""
    out: dict[str, np.ndarray] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        arr = np.asarray(leaf)
        names = stacked_fqns(path, arr)
        if names is None:
            out[fqn_of(path)] = arr
        else:
            out.update({n: np.ascontiguousarray(a) for n, a in zip(names, arr, strict=True)})
    return out


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter FQN of the model and its shape (the buffers left out)."""
    return split_buffers(tensor_shapes(cfg))[0]


def buffer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every buffer (``moezero.plan.model_buffers``: the expert biases) of the model and its
    shape."""
    return split_buffers(tensor_shapes(cfg))[1]


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every FQN of the params tree (parameters and buffers) and its shape, without
    allocating anything."""
    abstract = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))
    shapes: dict[str, tuple[int, ...]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        names = stacked_fqns(path, leaf)
        if names is None:
            shapes[fqn_of(path)] = leaf.shape
        else:
            shapes.update({n: leaf.shape[1:] for n in names})
    return shapes


def _check_keys(flat: dict, cfg: ModelConfig) -> None:
    expected = tensor_shapes(cfg)
    missing, unexpected = expected.keys() - flat.keys(), flat.keys() - expected.keys()
    bad = [f"{k}: {tuple(flat[k].shape)} != {v}" for k, v in expected.items()
           if k in flat and tuple(flat[k].shape) != tuple(v)]
    if missing or unexpected or bad:
        raise ValueError(f"weights do not match the model: missing={sorted(missing)} "
                         f"unexpected={sorted(unexpected)} wrong shapes={bad}")


def from_fqn_dict(flat: dict[str, np.ndarray], cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """Build params from ``{fqn: array}`` (any array-like: numpy, safetensors output, ...).

    Raises ValueError naming every missing, unexpected or mis-shaped FQN.
    """
    _check_keys(flat, cfg)
    abstract = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))

    def build(path, leaf):
        names = stacked_fqns(path, leaf)
        if names is None:
            arr = np.asarray(flat[fqn_of(path)])
        else:
            arr = np.stack([np.asarray(flat[n]) for n in names])
        return jnp.asarray(arr, dtype=dtype)

    return jax.tree_util.tree_map_with_path(build, abstract)


def save_params(path: str, params: dict, metadata: dict[str, str] | None = None) -> None:
    """Write params as one safetensors file keyed by FQN (fp32 masters as given)."""
    save_file(to_fqn_dict(params), path, metadata=metadata)


def load_params(path: str, cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """Read a safetensors file keyed by FQN into params for ``cfg``."""
    return from_fqn_dict(load_file(path), cfg, dtype=dtype)
