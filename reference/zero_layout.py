"""The layout of the ZeRO reference's sharded state: the plan's groups as *stacks*, flat
buffers by FQN, and the mesh.

Torch counterpart: ``moezero.zero.groups`` (``OptimizerGroups``: the same plan) and the flat
buffers and partitions of ``moezero.zero`` (``Optimizer.state_pieces``). The step
that uses this layout is ``reference/zero.py``; the plan itself is ``reference/plan/``.

Mesh ``("edp", "ep")`` of shape (W/ep, ep) (``make_mesh``); rank ``r = edp·ep + ep_index``. A
dense group is one stack sharded over all W devices; the k-th expert group of every EP rank
(same padded size) is one stack, device (edp i, ep j) holding DP rank i's shard of EP rank j's
group (``Stack``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from moezero.plan import GroupPlan, ParamSpec, Partition, UserGroup, plan_groups, plan_partitions
from moezero.plan.rules import (
    check_ep_size,
    expert_group_name,
    parse_expert_fqn,
    weight_decay_applies,
)
from moezero.reference.model import ModelConfig, init_params
from moezero.reference.optim import OptimConfig
from moezero.reference.scaling import LossScaleConfig
from moezero.reference.sharded import EDP, EP, RANKS
from moezero.reference.weights import (
    fqn_of,
    from_fqn_dict,
    param_shapes,
    path_keys,
    stacked_fqns,
)

ALL = (EDP, EP)  # every device, in rank order


# ---------------------------------------------------------------------------- the stacks


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
        user = "decay" if weight_decay_applies(fqn, shape) else "no_decay"  # = optim.decay_mask
        parts = parse_expert_fqn(fqn)
        if parts is None:
            specs.append(ParamSpec(fqn, tuple(shape), user_group=user))
            continue
        specs.append(ParamSpec(fqn, tuple(shape), user_group=user,
                               moe_group=expert_group_name(cfg.expert_group_name,
                                                           ep_size=cfg.ep_size),
                               ep_size=cfg.ep_size, layer=parts.layer, expert=parts.expert))
    return specs


def user_groups(cfg: ZeroConfig) -> tuple[UserGroup, ...]:
    """torch's ``config_user_group`` for this model (no expert / router lr)."""
    return (UserGroup("decay", {"weight_decay": cfg.optim.weight_decay, "lr_scale": 1.0}),
            UserGroup("no_decay", {"weight_decay": 0.0, "lr_scale": 1.0}))


@functools.cache
def plan_stacks(cfg: ZeroConfig) -> tuple[Stack, ...]:
    """The plan's groups and partitions, as stacks (see ``Stack``), in plan order."""
    if cfg.model.expert_bias:  # its update outside the optimizer is not modelled here
        raise ValueError("the sharded reference does not model moe.expert_bias")
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
    check_ep_size(ep_size=ep_size, world_size=world_size)
    return jax.make_mesh((world_size // ep_size, ep_size), ALL,
                         axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=jax.devices()[:world_size])


# --------------------------------------------------------------------- flat buffers by FQN


def fqn_views(tree) -> dict[str, jax.Array]:
    """Every param (or grad) flattened to 1-D by FQN, experts unstacked by global index."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = stacked_fqns(path, leaf)
        if names is None:
            out[fqn_of(path)] = leaf.reshape(-1)
        else:
            out.update({n: leaf[e].reshape(-1) for e, n in enumerate(names)})
    return out


def from_fqn_views(flat: dict[str, jax.Array], cfg: ModelConfig) -> dict:
    """Inverse of ``fqn_views``: the nested params tree (experts stacked)."""
    shapes = param_shapes(cfg)
    abstract = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))

    def build(path, leaf):
        names = stacked_fqns(path, leaf)
        if names is None:
            return flat[fqn_of(path)].reshape(shapes[fqn_of(path)])
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


def opt_specs(opt_state, stacks):
    """The ``PartitionSpec`` of every leaf of an optax state over the stacks (moments sharded
    like their stack, counts replicated)."""
    spec = {s.name: s.spec for s in stacks}
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: spec[path_keys(path)[-1]] if jnp.ndim(leaf) else P(), opt_state)
