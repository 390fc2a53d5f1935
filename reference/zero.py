"""The ZeRO-1/2 sharded optimizer step as a ``jax.shard_map``, and its unsharded twin.

Torch counterpart: ``torch_impl/zero.py`` (``ZeroOptimizer.reduce_gradients`` + ``step``) as
driven by ``torch_impl/engine.py``; the loss scaler is ``torch_impl.optim.LossScaler``.
Semantics: DESIGN.md §2 ("Sharded optimizer step", "Gold-standard equivalence").

Mesh ``("edp", "ep")`` of shape (W/ep, ep) (``make_mesh``); rank ``r = edp·ep + ep_index``.
Each device computes ``loss_fn`` on its rows ``[r·b, (r+1)·b)`` of the global batch with *all*
experts present (the forward is not expert-parallel here: ``reference/sharded.py`` checks that
separately). Then, per optimizer group of ``reference.plan`` (members flattened in group order,
padded to the group's ``Partition``):

- dense groups: ``psum_scatter`` over all W devices (P((edp, ep)): device r owns DP rank r);
- expert groups: the EP ranks' groups are stacked (one *stack*: the k-th group of every EP
  rank, same padded size) and reduce-scattered in two stages: over ``ep`` (what the EP
  all-to-all's backward accumulates on the expert owner: the EP group's tokens), then over
  ``edp`` (the ZeRO reduce-scatter of torch): device (i, j) owns DP rank i of EP rank j's group.

Sums run in fp32, are divided by W and stored in the compute dtype (as torch does). Then:
global norm from one ``psum`` of local sums of squares (each element once, padding is zero) and
of a non-finite count → upcast → unscale → × clip coef → optax AdamW on the fp32 shards (the
same ``optax.adamw`` as ``reference.optim``, one leaf per stack) → downcast → ``all_gather``
(over ``edp``, then over ``ep`` too: the reference forward needs every expert on every device;
torch keeps only its own). An overflow (non-finite gradient anywhere) keeps every shard and the
step count, on every device; the dynamic loss scale follows ``LossScaler`` exactly.

``twin_train_step`` is the oracle: plain optax on the full tree, with the gradient of the mean
of the W ranks' losses (``oracle_loss``'s rank slices), the same loss scaling and clipping.
Gradient accumulation over micro-batches is not modelled here (``reference/optim.py`` has it).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from reference.model import ModelConfig, cast_params, init_params, loss_fn, split_batch
from reference.optim import OptimConfig, clip_by_global_norm, lr_at, make_optimizer
from reference.plan import GroupPlan, ParamSpec, Partition, UserGroup, plan_groups, plan_partitions
from reference.sharded import EDP, EP, RANKS
from reference.weights import from_fqn_dict, param_shapes

ALL = (EDP, EP)  # every device, in rank order
EXPERT_FQN = re.compile(r"^(?P<layer>.+)\.experts\.(?P<expert>\d+)\.(?P<rest>.+)$")


# ------------------------------------------------------------------------------ loss scaling


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """``precision.*`` fp16 keys; ``dynamic=False`` is a fixed scale of 1 (fp32, bf16)."""

    dynamic: bool = False
    initial_scale_power: int = 16
    window: int = 1000  # overflow-free steps before the scale doubles
    hysteresis: int = 2  # overflows absorbed before the scale halves
    min_scale: float = 1.0


class LossScaleState(NamedTuple):
    scale: jax.Array  # fp32
    good_steps: jax.Array  # int32: clean steps since the last overflow
    hysteresis_left: jax.Array  # int32


def init_loss_scale(cfg: LossScaleConfig) -> LossScaleState:
    scale = 2.0 ** cfg.initial_scale_power if cfg.dynamic else 1.0
    return LossScaleState(jnp.float32(scale), jnp.int32(0), jnp.int32(cfg.hysteresis))


def update_loss_scale(cfg: LossScaleConfig, state: LossScaleState, overflow) -> LossScaleState:
    """``LossScaler.update``: on overflow, halve (not below min) once hysteresis is used up;
    after ``window`` clean steps, double and refill the hysteresis."""
    if not cfg.dynamic:
        return state
    scale, good, left = state
    left_o = left - 1
    halve = left_o <= 0
    scale_o = jnp.where(halve, jnp.maximum(scale / 2, cfg.min_scale), scale)
    left_o = jnp.where(halve, cfg.hysteresis, left_o)
    good_c = good + 1
    grow = good_c % cfg.window == 0
    scale_c, left_c = jnp.where(grow, scale * 2, scale), jnp.where(grow, cfg.hysteresis, left)
    return LossScaleState(jnp.where(overflow, scale_o, scale_c).astype(jnp.float32),
                          jnp.where(overflow, 0, good_c).astype(jnp.int32),
                          jnp.where(overflow, left_o, left_c).astype(jnp.int32))


# -------------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """Everything static about a sharded run (hashable: jit-static)."""

    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    world_size: int = 1
    ep_size: int = 1
    dtype: str = "float32"  # compute dtype of params and gradients; masters and moments fp32
    loss_scale: LossScaleConfig = LossScaleConfig()
    max_group_size: int | None = None  # ``moe.max_group_size``
    split_by_expert: bool = True  # ``moe.split_groups_by_expert``
    expert_group_name: str | None = None  # ``moe.expert_group_name``; None: ``ep_size_{ep}``


@dataclasses.dataclass(frozen=True)
class Stack:
    """Groups sharded as one array: a dense group, or the k-th group of every EP rank.

    The global array is the groups' padded flat buffers back to back (EP-rank order), split
    by ``spec``: device (edp i, ep j) holds DP rank i's shard of group j (dense: of rank r).
    """

    name: str  # the (EP rank 0) group's name
    groups: tuple[GroupPlan, ...]
    partitions: tuple[Partition, ...]
    decay: bool

    @property
    def is_expert(self) -> bool:
        return self.groups[0].is_expert

    @property
    def padded_numel(self) -> int:
        return self.partitions[0].padded_numel

    @property
    def spec(self) -> P:
        return P((EP, EDP)) if self.is_expert else RANKS


def param_specs(cfg: ZeroConfig) -> list[ParamSpec]:
    """The plan's specs of the model, with the user groups torch builds (decay / no_decay)."""
    specs = []
    for fqn, shape in param_shapes(cfg.model).items():
        user = "no_decay" if fqn.endswith("norm.weight") else "decay"  # = optim.decay_mask
        match = EXPERT_FQN.match(fqn)
        if match is None:
            specs.append(ParamSpec(fqn, tuple(shape), user_group=user))
            continue
        specs.append(ParamSpec(fqn, tuple(shape), user_group=user,
                               moe_group=cfg.expert_group_name or f"ep_size_{cfg.ep_size}",
                               ep_size=cfg.ep_size, layer=match["layer"],
                               expert=int(match["expert"])))
    return specs


def user_groups(cfg: ZeroConfig) -> tuple[UserGroup, ...]:
    """torch's ``config_user_group`` for this model (no expert / router lr)."""
    return (UserGroup("decay", {"weight_decay": cfg.optim.weight_decay, "lr_scale": 1.0}),
            UserGroup("no_decay", {"weight_decay": 0.0, "lr_scale": 1.0}))


@functools.cache
def plan_stacks(cfg: ZeroConfig) -> tuple[Stack, ...]:
    """The plan's groups and partitions, as stacks (see ``Stack``), in plan order."""
    groups = plan_groups(param_specs(cfg), max_group_size=cfg.max_group_size,
                         split_by_expert=cfg.split_by_expert)
    parts = plan_partitions(groups, world_size=cfg.world_size)
    stacks = [Stack(g.name, (g,), (p,), g.user_group == "decay")
              for g, p in zip(groups, parts, strict=True) if not g.is_expert]
    by_rank: dict[tuple[str, int], list[int]] = {}
    for i, g in enumerate(groups):
        if g.is_expert:
            by_rank.setdefault((g.moe_group, g.ep_rank), []).append(i)
    for moe_group in dict.fromkeys(g.moe_group for g in groups if g.is_expert):
        lists = [by_rank.get((moe_group, j), []) for j in range(cfg.ep_size)]
        for idx in zip(*lists, strict=True):
            members = [groups[i] for i in idx]
            if len({(parts[i].padded_numel, groups[i].user_group) for i in idx}) != 1:
                raise ValueError(f"expert groups {[g.name for g in members]} differ in size or "
                                 "user group across EP ranks: they cannot be stacked")
            stacks.append(Stack(members[0].name, tuple(members), tuple(parts[i] for i in idx),
                                members[0].user_group == "decay"))
    return tuple(stacks)


def make_mesh(world_size: int, ep_size: int) -> Mesh:
    """A (W/ep, ep) mesh ``("edp", "ep")`` over the first W devices (Auto axes)."""
    if world_size % ep_size:
        raise ValueError(f"ep_size {ep_size} does not divide world_size {world_size}")
    return jax.make_mesh((world_size // ep_size, ep_size), ALL,
                         axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=jax.devices()[:world_size])


# --------------------------------------------------------------------- flat buffers by FQN


def _keys(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]


def fqn_views(tree) -> dict[str, jax.Array]:
    """Every param (or grad) flattened to 1-D by FQN, experts unstacked by global index."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = _keys(path)
        if "experts" in keys:
            i = keys.index("experts") + 1
            for e in range(leaf.shape[0]):
                out[".".join([*keys[:i], str(e), *keys[i:]])] = leaf[e].reshape(-1)
        else:
            out[".".join(keys)] = leaf.reshape(-1)
    return out


def from_fqn_views(flat: dict[str, jax.Array], cfg: ModelConfig) -> dict:
    """Inverse of ``fqn_views``: the nested params tree (experts stacked)."""
    shapes = param_shapes(cfg)
    abstract = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))

    def build(path, leaf):
        keys = _keys(path)
        if "experts" not in keys:
            name = ".".join(keys)
            return flat[name].reshape(shapes[name])
        i = keys.index("experts") + 1
        names = [".".join([*keys[:i], str(e), *keys[i:]]) for e in range(leaf.shape[0])]
        return jnp.stack([flat[n].reshape(shapes[n]) for n in names])

    return jax.tree_util.tree_map_with_path(build, abstract)


def group_buffer(views: dict[str, jax.Array], part: Partition, dtype) -> jax.Array:
    """A group's padded flat buffer: member slices in group order, then zeros."""
    pieces = [views[m.fqn][m.start:m.stop].astype(dtype) for m, _ in part.offsets]
    pieces.append(jnp.zeros(part.padded_numel - part.numel, dtype))
    return jnp.concatenate(pieces)


def unflatten_groups(buffers: dict[str, jax.Array], stacks, cfg: ModelConfig) -> dict:
    """Params tree from every group's full buffer (keyed by group name); padding dropped."""
    pieces: dict[str, list[tuple[int, jax.Array]]] = {}
    for stack in stacks:
        for group, part in zip(stack.groups, stack.partitions, strict=True):
            for member, offset in part.offsets:
                piece = buffers[group.name][offset:offset + member.numel]
                pieces.setdefault(member.fqn, []).append((member.start, piece))
    flat = {fqn: jnp.concatenate([p for _, p in sorted(found, key=lambda t: t[0])])
            for fqn, found in pieces.items()}
    return from_fqn_views(flat, cfg)


@functools.partial(jax.jit, static_argnums=0)
def stack_arrays(cfg: ZeroConfig, tree: dict) -> dict[str, jax.Array]:
    """Every stack's global (unsharded) fp32 array: its groups' padded buffers back to back."""
    views = fqn_views(tree)
    return {s.name: jnp.concatenate([group_buffer(views, p, jnp.float32) for p in s.partitions])
            for s in plan_stacks(cfg)}


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
    """``reference.optim.make_optimizer``'s AdamW, decay masked per stack by user group."""
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
                      {s.name: s.spec for s in stacks}, _opt_specs(state.opt_state, stacks),
                      jax.tree.map(lambda _: P(), state.loss_scale))
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, P))


def init_twin_state(cfg: ZeroConfig, params: dict) -> TwinState:
    return TwinState(jnp.int32(0), params, make_optimizer(cfg.optim).init(params),
                     init_loss_scale(cfg.loss_scale))


def stack_fqns(cfg: ZeroConfig, stacked: dict) -> dict[str, np.ndarray]:
    """``{fqn: np.ndarray}`` (host copies) of a stack dict: the masters, or ``mu``/``nu``."""
    pieces: dict[str, list[tuple[int, np.ndarray]]] = {}
    for s in plan_stacks(cfg):
        rows = np.asarray(stacked[s.name]).reshape(len(s.groups), s.padded_numel)
        for row, part in zip(rows, s.partitions, strict=True):
            for member, offset in part.offsets:
                pieces.setdefault(member.fqn, []).append(
                    (member.start, row[offset:offset + member.numel]))
    shapes = param_shapes(cfg.model)
    return {fqn: np.concatenate([p for _, p in sorted(pieces[fqn], key=lambda t: t[0])])
            .reshape(shapes[fqn]) for fqn in shapes}


def master_params(cfg: ZeroConfig, stacked: dict) -> dict:
    """The full params tree of a stack dict (``stack_fqns`` as a tree, fp32)."""
    return from_fqn_dict(stack_fqns(cfg, stacked), cfg.model)


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


def _clip(cfg: ZeroConfig, norm):
    max_norm = cfg.optim.gradient_clipping
    if not max_norm:
        return jnp.float32(1.0)
    return jnp.where(jnp.isfinite(norm) & (norm > max_norm), max_norm / norm, 1.0)


def _device_step(cfg: ZeroConfig, stacks, params, batch, mult, master, opt_state, scale):
    """One device's part of the step (inside ``shard_map``)."""
    grads, loss = _local_grads(cfg, params, batch, mult, scale)
    views = fqn_views(grads)
    shards = {s.name: _reduce_scatter(cfg, s, views) for s in stacks}
    local = jnp.stack([sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in shards.values()),
                       sum(jnp.sum(~jnp.isfinite(g)).astype(jnp.float32)
                           for g in shards.values())])
    sq, bad = jax.lax.psum(local, ALL)  # one all-reduce: norm² and the overflow vote
    overflow = bad > 0
    norm = jnp.where(overflow, jnp.inf, jnp.sqrt(sq) / scale)
    coef = _clip(cfg, norm)
    g32 = {k: g.astype(jnp.float32) * (1.0 / scale) * coef for k, g in shards.items()}
    updates, new_opt = make_stack_optimizer(cfg, stacks).update(g32, opt_state, master)
    new_master = optax.apply_updates(master, updates)
    keep = lambda old, new: jnp.where(overflow, old, new)
    master, opt_state = jax.tree.map(keep, (master, opt_state), (new_master, new_opt))
    buffers = {}
    for s in stacks:
        buffers.update(_all_gather(s, master[s.name].astype(jnp.dtype(cfg.dtype))))
    params = unflatten_groups(buffers, stacks, cfg.model)
    metrics = {"loss": jax.lax.pmean(loss, ALL), "grad_norm": norm, "clip_coef": coef,
               "skipped": overflow}
    return params, master, opt_state, metrics


def _opt_specs(opt_state, stacks):
    spec = {s.name: s.spec for s in stacks}
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: spec[_keys(path)[-1]] if jnp.ndim(leaf) else P(), opt_state)


def zero_train_step(cfg: ZeroConfig, mesh: Mesh, state: ZeroState, batch: jax.Array,
                    loss_mult: jax.Array | None = None):
    """One sharded optimizer step on the global batch [W·b, S+1]. Pure; jit with cfg, mesh static.

    ``loss_mult`` ([W], default ones) multiplies each rank's loss: a test hook to inject an
    overflow on one rank (``inf``), as torch's tests multiply one rank's loss.
    """
    stacks = plan_stacks(cfg)
    mult = jnp.ones(cfg.world_size, jnp.float32) if loss_mult is None else loss_mult
    master_specs = {s.name: s.spec for s in stacks}
    fn = jax.shard_map(
        functools.partial(_device_step, cfg, stacks), mesh=mesh,
        in_specs=(P(), RANKS, RANKS, master_specs, _opt_specs(state.opt_state, stacks), P()),
        out_specs=(P(), master_specs, _opt_specs(state.opt_state, stacks), P()))
    params, master, opt_state, metrics = fn(state.params, batch, mult, state.master,
                                            state.opt_state, state.loss_scale.scale)
    new_state, metrics = _finish(cfg, state, metrics, params=params, master=master,
                                 opt_state=opt_state)
    placed = jax.lax.with_sharding_constraint(new_state, state_shardings(cfg, mesh, new_state))
    return placed, metrics


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
    g32 = jax.tree.map(lambda g: g.astype(jnp.float32) * (1.0 / scale), grads)
    overflow = ~jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(g32)]))
    g32, norm, coef = clip_by_global_norm(g32, cfg.optim.gradient_clipping)
    updates, new_opt = make_optimizer(cfg.optim).update(g32, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    keep = lambda old, new: jnp.where(overflow, old, new)
    params, opt_state = jax.tree.map(keep, (state.params, state.opt_state), (new_params, new_opt))
    metrics = {"loss": loss, "grad_norm": jnp.where(overflow, jnp.inf, norm), "clip_coef": coef,
               "skipped": overflow}
    return _finish(cfg, state, metrics, params=params, opt_state=opt_state)

