"""AdamW train step (optax): warmup + cosine schedule, global-norm clipping, masked decay.

Torch counterpart: ``torch_impl/optim`` (schedule, clipping, AdamW math) as driven by
``torch_impl/engine`` — the unsharded meaning of the ZeRO step in DESIGN.md §2.

``train_step(cfg, state, batch) -> (new_state, metrics)`` is pure; jit it with
``jax.jit(train_step, static_argnums=0)``. The loss is ``reference.model.oracle_loss`` over
``cfg.world_size`` rank slices, so one call is one optimizer step of a W-rank run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from reference.model import ModelConfig, oracle_loss

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), capped at 1


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW + schedule hyperparameters (``optimizer.*`` config keys)."""

    lr: float = 3e-4  # peak learning rate
    min_lr: float = 0.0  # value the cosine decays to at ``total_steps``
    warmup_steps: int = 0
    total_steps: int = 1000
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled (AdamW); never applied to norm gains
    grad_clip: float | None = 1.0  # max global grad norm; None or <= 0 disables clipping


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    world_size: int = 1  # W: the batch is split into W rank slices, each routed on its own
    dtype: str = "float32"  # compute dtype; masters, grads and optimizer state stay fp32


class TrainState(NamedTuple):
    step: jax.Array  # int32: optimizer steps taken
    params: dict  # fp32 masters
    opt_state: optax.OptState


def lr_at(cfg: OptimConfig, step) -> jax.Array:
    """LR for update number ``step`` (0-based): linear warmup to ``lr``, cosine to ``min_lr``.

    Warmup: ``lr·(step+1)/warmup_steps`` for step < warmup_steps. Then with
    ``p = clip((step − warmup)/max(1, total − warmup), 0, 1)``:
    ``min_lr + (lr − min_lr)·(1 + cos(π·p))/2``.
    """
    step = jnp.asarray(step, jnp.float32)
    warm = cfg.lr * (step + 1) / max(cfg.warmup_steps, 1)
    progress = jnp.clip((step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps),
                        0.0, 1.0)
    cosine = cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + jnp.cos(math.pi * progress))
    return jnp.where(step < cfg.warmup_steps, warm, cosine)


def decay_mask(params: dict) -> dict:
    """True where weight decay applies: every param except RMSNorm gains (``*norm.weight``)."""
    def decays(path, _):
        return not ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) \
            .endswith("norm.weight")
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """optax AdamW with the schedule and the norm-gain decay mask (clipping is separate)."""
    return optax.adamw(lambda count: lr_at(cfg, count), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                       weight_decay=cfg.weight_decay, mask=decay_mask)


def init_train_state(cfg: TrainConfig, params: dict) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, make_optimizer(cfg.optim).init(params))


def clip_by_global_norm(grads, max_norm: float | None):
    """Scale grads by ``min(1, max_norm/(norm + 1e-6))``; returns (grads, norm, coef)."""
    norm = optax.global_norm(grads)
    if not max_norm or max_norm <= 0:
        return grads, norm, jnp.ones((), jnp.float32)
    coef = jnp.minimum(1.0, max_norm / (norm + CLIP_EPS))
    return jax.tree.map(lambda g: g * coef, grads), norm, coef


def loss_and_grads(cfg: TrainConfig, params: dict, batch: jax.Array):
    """Mean loss, metrics and grads over micro-batches: batch is [W·b, S+1] or [M, W·b, S+1]."""
    micro = batch if batch.ndim == 3 else batch[None]

    def micro_loss(p, tokens):
        return oracle_loss(p, tokens, cfg.model, cfg.world_size, dtype=jnp.dtype(cfg.dtype))

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    results = [grad_fn(params, micro[m]) for m in range(micro.shape[0])]
    (_, metrics), grads = jax.tree.map(lambda *xs: sum(xs) / len(xs), *results)
    return metrics, grads


def train_step(cfg: TrainConfig, state: TrainState, batch: jax.Array):
    """One optimizer step: grads (micro-batches averaged) → clip → AdamW. Pure."""
    metrics, grads = loss_and_grads(cfg, state.params, batch)
    grads, norm, coef = clip_by_global_norm(grads, cfg.optim.grad_clip)
    updates, opt_state = make_optimizer(cfg.optim).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "grad_norm": norm, "clip_coef": coef,
               "lr": lr_at(cfg.optim, state.step)}
    return TrainState(state.step + 1, params, opt_state), metrics
