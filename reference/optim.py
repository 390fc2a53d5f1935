"""AdamW train step (optax): warmup + cosine schedule, global-norm clipping, masked decay.

Torch counterpart: ``moezero.zero.adamw`` (schedule, clipping) and ``moezero.zero.hostadam``
(the AdamW math) as driven by
``moezero.zero.optimizer`` and ``moezero.engine``: this is the unsharded meaning of the ZeRO
step in docs/design.md, "Semantics" (fp16 loss scaling and per-group lr scales are not modelled here).

``train_step(cfg, state, batch) -> (new_state, metrics)`` is pure; jit it with
``jax.jit(train_step, static_argnums=0)``. The loss is ``moezero.reference.model.oracle_loss`` over
``cfg.world_size`` rank slices, so one call is one optimizer step of a W-rank run.

Frozen parameters (``TrainConfig.freeze``, the ``train.freeze`` patterns of
``moezero.plan.freeze``) get a zero gradient before clipping (they are in no optimizer group,
so the global norm leaves them out) and a zero update: they never change. Their Adam moments
stay zero; the torch side holds none.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from moezero.plan.freeze import frozen_fqns
from moezero.plan.model_buffers import is_buffer
from moezero.plan.rules import weight_decay_applies
from moezero.reference.model import ModelConfig, oracle_loss
from moezero.reference.moe import update_expert_bias
from moezero.reference.weights import fqn_of, stacked_fqns


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW + schedule hyperparameters, named as the ``optimizer.*`` config keys."""

    lr: float = 3e-3  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled (AdamW); where ``decay_mask`` says (not norm gains)
    gradient_clipping: float | None = 1.0  # max global grad norm; None or 0 disables
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # the cosine ends at lr·min_lr_ratio
    total_steps: int = 1000  # ``train.steps``: where the cosine ends


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    world_size: int = 1  # W: the batch is split into W rank slices, each routed on its own
    dtype: str = "float32"  # compute dtype; masters, grads and optimizer state stay fp32
    freeze: tuple[str, ...] = ()  # ``train.freeze``: FQN patterns never trained


class TrainState(NamedTuple):
    step: jax.Array  # int32: optimizer steps taken
    params: dict  # fp32 masters
    opt_state: optax.OptState


def lr_at(cfg: OptimConfig, step) -> jax.Array:
    """LR of update number ``step`` (0-based): linear warmup, then cosine to lr·min_lr_ratio.

    Warmup: ``lr·(step+1)/warmup_steps`` for step < warmup_steps. Then with
    ``p = min((step − warmup)/max(total − warmup, 1), 1)``:
    ``lr·(ratio + (1 − ratio)·(1 + cos(π·p))/2)``.
    """
    step = jnp.asarray(step, jnp.float32)
    warm = cfg.lr * (step + 1) / max(cfg.warmup_steps, 1)
    progress = jnp.minimum((step - cfg.warmup_steps) / max(cfg.total_steps - cfg.warmup_steps, 1),
                           1.0)
    cosine = 0.5 * (1.0 + jnp.cos(math.pi * progress))
    decayed = cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)
    return jnp.where(step < cfg.warmup_steps, warm, decayed)


def decay_mask(params: dict) -> dict:
    """True where weight decay applies, by the plan's ``weight_decay_applies`` (the rule the
    torch side's user groups follow): matrices, not norm gains (QK-norm gains included), biases
    or other vectors; never buffers (the expert bias), which the optimizer leaves alone. A
    stack of experts is asked with one expert's FQN and shape (every expert of a stack has the
    same)."""
    def decays(path, leaf):
        names = stacked_fqns(path, leaf)
        if names is None:
            fqn = fqn_of(path)
            return weight_decay_applies(fqn, leaf.shape) and not is_buffer(fqn)
        return weight_decay_applies(names[0], leaf.shape[1:])
    return jax.tree_util.tree_map_with_path(decays, params)


def trained_mask(params: dict, freeze: tuple[str, ...]) -> dict:
    """1.0 where a parameter trains, 0.0 where ``freeze`` freezes it (buffers count as trained:
    the optimizer leaves them alone anyway). A stack of experts gets one value per expert,
    shaped to broadcast over the stack."""
    names = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names[path] = stacked_fqns(path, leaf) or (fqn_of(path),)
    every = [n for found in names.values() for n in found if not is_buffer(n)]
    frozen = frozen_fqns(freeze, every) if freeze else frozenset()

    def mask(path, leaf):
        if stacked_fqns(path, leaf) is None:
            return jnp.float32(fqn_of(path) not in frozen)
        keep = jnp.asarray([n not in frozen for n in names[path]], jnp.float32)
        return keep.reshape((-1,) + (1,) * (leaf.ndim - 1))
    return jax.tree_util.tree_map_with_path(mask, params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """optax AdamW with the schedule and the norm-gain decay mask (clipping is separate)."""
    return optax.adamw(lambda count: lr_at(cfg, count), b1=cfg.betas[0], b2=cfg.betas[1],
                       eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)


def init_train_state(cfg: TrainConfig, params: dict) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, make_optimizer(cfg.optim).init(params))


def clip_by_global_norm(grads, max_norm: float | None):
    """Scale grads by ``max_norm/norm`` when norm > max_norm (optax rule, no epsilon).

    A non-finite norm leaves grads unscaled (the fp16 overflow skip deals with it).
    Returns (grads, norm, coef).
    """
    norm = optax.tree.norm(grads)
    if not max_norm:
        return grads, norm, jnp.ones((), jnp.float32)
    coef = jnp.where(jnp.isfinite(norm) & (norm > max_norm), max_norm / norm, 1.0)
    return jax.tree.map(lambda g: g * coef, grads), norm, coef


def loss_and_grads(cfg: TrainConfig, params: dict, batch: jax.Array):
    """Mean loss, metrics and grads over micro-batches: batch is [W·b, S+1] or [M, W·b, S+1]."""
    micro = batch if batch.ndim == 3 else batch[None]

    def micro_loss(p, tokens):
        return oracle_loss(p, tokens, cfg.model, cfg.world_size, dtype=jnp.dtype(cfg.dtype))

    def accumulate(total, tokens):
        (_, metrics), grads = jax.value_and_grad(micro_loss, has_aux=True)(params, tokens)
        return jax.tree.map(jnp.add, total, (metrics, grads)), None

    zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(micro_loss, params, micro[0])[1])
    total, _ = jax.lax.scan(accumulate, (zero, jax.tree.map(jnp.zeros_like, params)), micro)

    def mean(t):  # integer counts (the expert load) are summed over micro-batches
        return t if jnp.issubdtype(t.dtype, jnp.integer) else t / micro.shape[0]
    return jax.tree.map(mean, total)


def update_buffers(cfg: TrainConfig, params: dict, load_LE: jax.Array | None) -> dict:
    """After the optimizer: each MoE layer's expert bias steps on its global load (summed
    over ranks and micro-batches; ``load_LE`` has a row per MoE layer, dense layers have
    none), ``moezero.reference.moe.update_expert_bias``."""
    if load_LE is None:
        return params
    loads = iter(load_LE)

    def updated(layer: dict) -> dict:
        if "moe" not in layer:
            return layer
        router = layer["moe"]["router"]
        bias = update_expert_bias(router["expert_bias"], next(loads),
                                  cfg.model.bias_update_rate)
        return {**layer, "moe": {**layer["moe"], "router": {**router, "expert_bias": bias}}}
    layers = [updated(layer) for layer in params["layers"]]
    return {**params, "layers": layers}


def train_step(cfg: TrainConfig, state: TrainState, batch: jax.Array):
    """One optimizer step: grads (micro-batches averaged) → clip → AdamW → expert-bias
    update (buffers: no gradient, no decay, so AdamW leaves them unchanged). Pure."""
    metrics, grads = loss_and_grads(cfg, state.params, batch)
    load_LE = metrics.pop("expert_load", None)
    keep = trained_mask(state.params, cfg.freeze)
    grads = jax.tree.map(jnp.multiply, grads, keep)
    grads, norm, coef = clip_by_global_norm(grads, cfg.optim.gradient_clipping)
    updates, opt_state = make_optimizer(cfg.optim).update(grads, state.opt_state, state.params)
    updates = jax.tree.map(jnp.multiply, updates, keep)
    params = update_buffers(cfg, optax.apply_updates(state.params, updates), load_LE)
    metrics = {**metrics, "grad_norm": norm, "clip_coef": coef,
               "lr": lr_at(cfg.optim, state.step)}
    return TrainState(state.step + 1, params, opt_state), metrics
