"""The ZeRO-1/2 sharded optimizer step as a ``jax.shard_map``, and its unsharded twin.

Torch counterpart: ``moezero.zero`` (``Optimizer.reduce_gradients`` + ``step`` of
``sharded.ShardedOptimizer``) as driven by ``moezero.engine``. Loss scaling and the clip coefficient are
``reference/scaling.py`` (torch: ``moezero.zero.adamw.LossScaler``, ``clip_coef``); the stacks,
flat buffers and mesh are ``reference/zero_layout.py``. Semantics: docs/design.md, "Semantics"
(the sharded step, the equivalence).

Mesh ``("edp", "ep")`` of shape (W/ep, ep) (``make_mesh``); rank ``r = edp·ep + ep_index``.
Each device computes ``loss_fn`` on its rows ``[r·b, (r+1)·b)`` of the global batch with *all*
experts present (the forward is not expert-parallel here: ``reference/sharded.py`` checks that
separately). Then, per optimizer group of ``moezero.plan`` (members flattened in group order,
padded to the group's ``Partition``):

- dense groups: ``psum_scatter`` over all W devices (P((edp, ep)): device r owns DP rank r);
- expert groups: the EP ranks' groups are stacked (one *stack*: the k-th group of every EP
  rank, same padded size) and reduce-scattered in two stages: over ``ep`` (what the EP
  all-to-all's backward accumulates on the expert owner: the EP group's tokens), then over
  ``edp`` (the ZeRO reduce-scatter of torch): device (i, j) owns DP rank i of EP rank j's group.

Sums run in fp32, are divided by W and stored in the compute dtype (as torch does). Then:
global norm from one ``psum`` of local sums of squares (each element once, padding is zero) and
of a non-finite count → upcast → unscale → × clip coef → optax AdamW on the fp32 shards (the
same ``optax.adamw`` as ``moezero.reference.optim``, one leaf per stack) → downcast → ``all_gather``
(over ``edp``, then over ``ep`` too: the reference forward needs every expert on every device;
torch keeps only its own). An overflow (non-finite gradient anywhere) keeps every shard and the
step count, on every device; the dynamic loss scale follows ``LossScaler`` exactly.

``twin_train_step`` is the oracle: plain optax on the full tree, with the gradient of the mean
of the W ranks' losses (``oracle_loss``'s rank slices), the same loss scaling and clipping
(its norm summed over flat leaves: as accurate as the sharded step's).
Gradient accumulation over micro-batches is not modelled here (``reference/optim.py`` has it).

``zero_apply_grads`` and ``twin_apply_grads`` are the same two steps from given gradients (every
rank's local gradient, resp. their mean) instead of a forward and backward: the optimizer step
alone (reduce-scatter → norm → unscale → clip → AdamW → gather, loss scale update), which the
parity suite feeds with torch's own gradients and state to compare one step's numerics.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moezero.reference.model import cast_params, loss_fn, split_batch
from moezero.reference.optim import lr_at, make_optimizer
from moezero.reference.scaling import LossScaleState, clip_coef, init_loss_scale, update_loss_scale
from moezero.reference.sharded import EDP, EP, RANKS
from moezero.reference.zero_layout import (
    ALL,
    Stack,
    ZeroConfig,
    fqn_views,
    group_buffer,
    opt_specs,
    plan_stacks,
    stack_arrays,
    unflatten_groups,
)

# -------------------------------------------------------------------------------- states


class ZeroState(NamedTuple):
    step: jax.Array  # int32: optimizer steps taken (skipped steps excluded)
    params: dict  # compute-dtype params, replicated (the all-gathered downcast masters)
    master: dict  # {stack name: fp32 global array}, sharded by ``Stack.spec``
    opt_state: optax.OptState  # optax adamw state over ``master`` (moments sharded alike)
    loss_scale: LossScaleState


class TwinState(NamedTuple):
    step: jax.Array
    params: dict  # fp32 masters, full tree
    opt_state: optax.OptState
    loss_scale: LossScaleState


def make_stack_optimizer(cfg: ZeroConfig, stacks) -> optax.GradientTransformation:
    """``moezero.reference.optim.make_optimizer``'s AdamW, decay masked per stack by user group."""
    o = cfg.optim
    mask = {s.name: s.decay for s in stacks}
    return optax.adamw(lambda count: lr_at(o, count), b1=o.betas[0], b2=o.betas[1], eps=o.eps,
                       weight_decay=o.weight_decay, mask=mask)


def init_zero_state(cfg: ZeroConfig, mesh: Mesh, params: dict) -> ZeroState:
    """Shard fp32 ``params`` into the stacks' masters (placed on ``mesh``), zero moments."""
    stacks = plan_stacks(cfg)
    master = stack_arrays(cfg, params)
    state = ZeroState(jnp.int32(0), cast_params(params, jnp.dtype(cfg.dtype)), master,
                      make_stack_optimizer(cfg, stacks).init(master),
                      init_loss_scale(cfg.loss_scale))
    return jax.device_put(state, state_shardings(cfg, mesh, state))


def state_shardings(cfg: ZeroConfig, mesh: Mesh, state: ZeroState) -> ZeroState:
    """Where a ``ZeroState`` lives: shards by ``Stack.spec``, everything else replicated.

    ``zero_train_step`` returns its state placed exactly so, so jit compiles it once.
    """
    stacks = plan_stacks(cfg)
    specs = ZeroState(P(), jax.tree.map(lambda _: P(), state.params),
                      {s.name: s.spec for s in stacks}, opt_specs(state.opt_state, stacks),
                      jax.tree.map(lambda _: P(), state.loss_scale))
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, P))


def init_twin_state(cfg: ZeroConfig, params: dict) -> TwinState:
    return TwinState(jnp.int32(0), params, make_optimizer(cfg.optim).init(params),
                     init_loss_scale(cfg.loss_scale))


def adam_moments(opt_state) -> tuple:
    """(mu, nu) of an optax adamw state (trees like its params)."""
    return optax.tree.get(opt_state, "mu"), optax.tree.get(opt_state, "nu")


# ------------------------------------------------------------------------------ the step


def _local_grads(cfg: ZeroConfig, params, batch, mult, scale):
    """This device's loss and grads of ``loss · mult · scale`` w.r.t. its compute params."""
    varying = jax.lax.pcast(params, ALL, to="varying")  # local grads, no implicit psum

    def scaled(p):
        loss, _ = loss_fn(p, batch, cfg.model, dtype=jnp.dtype(cfg.dtype))
        return loss * mult[0] * scale, loss

    return jax.grad(scaled, has_aux=True)(varying)


def _reduce_scatter(cfg: ZeroConfig, stack: Stack, views) -> jax.Array:
    """This device's shard of the stack's (sum / W) gradient, in the compute dtype."""
    bufs = [group_buffer(views, p, jnp.float32) for p in stack.partitions]
    if stack.is_expert:  # EP group's tokens first (owner), then the EDP reduce-scatter
        summed = jax.lax.psum_scatter(jnp.stack(bufs), EP, scatter_dimension=0)
        shard = jax.lax.psum_scatter(summed, EDP, scatter_dimension=0, tiled=True)
    else:
        shard = jax.lax.psum_scatter(bufs[0], ALL, scatter_dimension=0, tiled=True)
    return (shard / cfg.world_size).astype(jnp.dtype(cfg.dtype))


def _all_gather(stack: Stack, shard: jax.Array) -> dict[str, jax.Array]:
    """Every group of the stack, full (padded), on every device."""
    if not stack.is_expert:
        return {stack.name: jax.lax.all_gather(shard, ALL, tiled=True, to="invarying")}
    group = jax.lax.all_gather(shard, EDP, tiled=True, to="invarying")
    rows = jax.lax.all_gather(group, EP, to="invarying")
    return {g.name: rows[j] for j, g in enumerate(stack.groups)}


def _device_update(cfg: ZeroConfig, stacks, grads, master, opt_state, scale):
    """One device's optimizer step from its local grads (inside ``shard_map``)."""
    views = fqn_views(grads)
    shards = {s.name: _reduce_scatter(cfg, s, views) for s in stacks}
    local = jnp.stack([sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in shards.values()),
                       sum(jnp.sum(~jnp.isfinite(g)).astype(jnp.float32)
                           for g in shards.values())])
    sq, bad = jax.lax.psum(local, ALL)  # one all-reduce: norm² and the overflow vote
    overflow = bad > 0
    norm = jnp.where(overflow, jnp.inf, jnp.sqrt(sq) / scale)
    coef = clip_coef(norm, cfg.optim.gradient_clipping)
    g32 = {k: g.astype(jnp.float32) * (1.0 / scale) * coef for k, g in shards.items()}
    updates, new_opt = make_stack_optimizer(cfg, stacks).update(g32, opt_state, master)
    new_master = optax.apply_updates(master, updates)
    keep = lambda old, new: jnp.where(overflow, old, new)
    master, opt_state = jax.tree.map(keep, (master, opt_state), (new_master, new_opt))
    buffers = {}
    for s in stacks:
        buffers.update(_all_gather(s, master[s.name].astype(jnp.dtype(cfg.dtype))))
    params = unflatten_groups(buffers, stacks, cfg.model)
    metrics = {"grad_norm": norm, "clip_coef": coef, "skipped": overflow}
    return params, master, opt_state, metrics


def _device_step(cfg: ZeroConfig, stacks, params, batch, mult, master, opt_state, scale):
    """One device's forward, backward and optimizer step (inside ``shard_map``)."""
    grads, loss = _local_grads(cfg, params, batch, mult, scale)
    params, master, opt_state, metrics = _device_update(cfg, stacks, grads, master, opt_state,
                                                        scale)
    return params, master, opt_state, {**metrics, "loss": jax.lax.pmean(loss, ALL)}


def _device_apply(cfg: ZeroConfig, stacks, grads_W, master, opt_state, scale):
    """``_device_update`` of this device's row of ``grads_W`` (inside ``shard_map``)."""
    return _device_update(cfg, stacks, jax.tree.map(lambda g: g[0], grads_W), master, opt_state,
                          scale)


def _sharded_step(cfg: ZeroConfig, mesh: Mesh, state: ZeroState, device_fn, inputs: tuple,
                  input_specs: tuple):
    """``device_fn(cfg, stacks, *inputs, master, opt_state, scale)`` on every device, then the
    step count and loss scale; the new state placed by ``state_shardings``."""
    stacks = plan_stacks(cfg)
    master_specs = {s.name: s.spec for s in stacks}
    state_specs = opt_specs(state.opt_state, stacks)
    fn = jax.shard_map(functools.partial(device_fn, cfg, stacks), mesh=mesh,
                       in_specs=(*input_specs, master_specs, state_specs, P()),
                       out_specs=(P(), master_specs, state_specs, P()))
    params, master, opt_state, metrics = fn(*inputs, state.master, state.opt_state,
                                            state.loss_scale.scale)
    new_state, metrics = _finish(cfg, state, metrics, params=params, master=master,
                                 opt_state=opt_state)
    placed = jax.lax.with_sharding_constraint(new_state, state_shardings(cfg, mesh, new_state))
    return placed, metrics


def zero_train_step(cfg: ZeroConfig, mesh: Mesh, state: ZeroState, batch: jax.Array,
                    loss_mult: jax.Array | None = None):
    """One sharded optimizer step on the global batch [W·b, S+1]. Pure; jit with cfg, mesh static.

    ``loss_mult`` ([W], default ones) multiplies each rank's loss: a test hook to inject an
    overflow on one rank (``inf``), as torch's tests multiply one rank's loss.
    """
    mult = jnp.ones(cfg.world_size, jnp.float32) if loss_mult is None else loss_mult
    return _sharded_step(cfg, mesh, state, _device_step, (state.params, batch, mult),
                         (P(), RANKS, RANKS))


def zero_apply_grads(cfg: ZeroConfig, mesh: Mesh, state: ZeroState, grads_W: dict):
    """The sharded optimizer step alone, from every rank's local gradients. Pure; jit with
    cfg, mesh static.

    ``grads_W``: a params tree whose leaves have a leading [W] axis, in the compute dtype; row
    r is rank r's gradient of its loss × the loss scale (what ``_local_grads`` computes; with
    ep > 1 only what torch's rank r holds: its EP rank's experts, zeros elsewhere, is the same
    input, as the ``ep`` reduction adds the zeros exactly). Metrics as ``zero_train_step``'s,
    without the loss.
    """
    return _sharded_step(cfg, mesh, state, _device_apply, (grads_W,), (RANKS,))


def _finish(cfg: ZeroConfig, state, metrics: dict, **new):
    """Step count, loss-scale update and the metrics every step reports."""
    overflow = metrics["skipped"]
    loss_scale = update_loss_scale(cfg.loss_scale, state.loss_scale, overflow)
    metrics = {**metrics, "lr": lr_at(cfg.optim, state.step), "loss_scale": loss_scale.scale}
    step = state.step + jnp.where(overflow, 0, 1).astype(jnp.int32)
    return state._replace(step=step, loss_scale=loss_scale, **new), metrics


def twin_train_step(cfg: ZeroConfig, state: TwinState, batch: jax.Array,
                    loss_mult: jax.Array | None = None):
    """The unsharded twin: grad of the mean of the W ranks' losses, plain optax on the tree."""
    dtype, scale = jnp.dtype(cfg.dtype), state.loss_scale.scale
    mult = jnp.ones(cfg.world_size, jnp.float32) if loss_mult is None else loss_mult

    def scaled(p):
        # a loop over the rank slices, as each rank computes its own (unrolled: W is small)
        loss_W = jnp.stack([loss_fn(p, b, cfg.model, dtype=dtype)[0]
                            for b in split_batch(batch, cfg.world_size)])
        return jnp.mean(loss_W * mult) * scale, jnp.mean(loss_W)

    grads, loss = jax.grad(scaled, has_aux=True)(cast_params(state.params, dtype))
    state, metrics = twin_apply_grads(cfg, state, grads)
    return state, {**metrics, "loss": loss}


def twin_apply_grads(cfg: ZeroConfig, state: TwinState, grads: dict):
    """The twin's optimizer step alone: ``grads`` is the gradient of the mean loss × the loss
    scale, in the compute dtype (``zero_apply_grads``'s oracle: the mean of its rows)."""
    scale = state.loss_scale.scale
    g32 = jax.tree.map(lambda g: g.astype(jnp.float32) * (1.0 / scale), grads)
    overflow = ~jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(g32)]))
    # Sums over flat leaves: XLA:CPU reduces an N-d array row by row, ~1e-6 off for a [64, 32]
    # leaf (``optax.tree.norm``); a 1-d one pairwise-like, ~1e-8, as the sharded step's shards.
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.reshape(-1))) for g in jax.tree.leaves(g32)))
    coef = clip_coef(norm, cfg.optim.gradient_clipping)
    g32 = jax.tree.map(lambda g: g * coef, g32)
    updates, new_opt = make_optimizer(cfg.optim).update(g32, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    keep = lambda old, new: jnp.where(overflow, old, new)
    params, opt_state = jax.tree.map(keep, (state.params, state.opt_state), (new_params, new_opt))
    metrics = {"grad_norm": jnp.where(overflow, jnp.inf, norm), "clip_coef": coef,
               "skipped": overflow}
    return _finish(cfg, state, metrics, params=params, opt_state=opt_state)
