"""The MoE layer with experts sharded over a device mesh (``jax.shard_map`` + ``all_to_all``).

Torch counterpart: the expert-parallel path of ``torch_impl/model/moe.py`` (docs/model.md,
"Expert parallelism"). Its oracle is ``moe_layer_per_slice``, the unsharded twin: the plain
``moezero.reference.moe.moe_layer`` run on each rank's token slice with all experts present.

Topology (docs/design.md, "Semantics"): W ranks on a mesh ``("edp", "ep")`` of shape (W/ep, ep); rank
``r = edp_index·ep + ep_index``, so EP groups are consecutive blocks of ``ep`` ranks, and the
ranks sharing an ``ep_index`` form an EDP group holding the same experts. Expert e lives on EP
rank ``e // (E/ep)``. Tokens are split evenly over all W ranks; every rank routes, caps and
computes aux/z on its own tokens. The exchange uses fixed [E, C, D] buffers (GShard style): the
empty slots are zeros that nobody reads, so it computes exactly what torch's unequal-split
``all_to_all_single`` computes. Replicated router grads are summed over all ranks and expert
grads over the EDP group by shard_map's transpose.

Shape legend: T local tokens, D model dim, F expert hidden dim, E experts (global),
N experts per EP rank (E/ep), C buffer slots per expert, W ranks, P = ep (EP group size),
X = P·C rows one local expert receives.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moezero.plan.rules import check_ep_size
from moezero.reference.moe import (
    apply_experts,
    assign_slots,
    aux_loss,
    buffer_slots,
    capacity,
    combine,
    dispatch,
    moe_layer,
    route,
    z_loss,
)

EDP, EP = "edp", "ep"
RANKS = P((EDP, EP))  # an axis split over all W ranks, in rank order


class ShardedMoEOut(NamedTuple):
    y_TD: jax.Array  # all ranks' outputs, rank-major (the input's token order)
    aux_W: jax.Array  # per-rank load-balancing loss
    z_W: jax.Array  # per-rank router z-loss


def make_mesh(world_size: int, ep: int) -> Mesh:
    """A (W/ep, ep) mesh over the first W devices, axes ``("edp", "ep")``."""
    check_ep_size(ep_size=ep, world_size=world_size)
    return jax.make_mesh((world_size // ep, ep), (EDP, EP),
                         axis_types=(AxisType.Explicit, AxisType.Explicit),
                         devices=jax.devices()[:world_size])


def _exchange(buf_PNCD: jax.Array) -> jax.Array:
    """Block p goes to EP rank p; block p of the result came from EP rank p."""
    return jax.lax.all_to_all(buf_PNCD, EP, split_axis=0, concat_axis=0)


def _local_moe(router_ED, experts_local, x_TD, *, ep: int, top_k: int,
               capacity_factor: float | None, lora_scale: float = 1.0):
    """One rank's MoE: route locally, send rows to expert owners, run, send back, combine."""
    num_tokens, dim = x_TD.shape
    num_experts = router_ED.shape[0]
    n = num_experts // ep
    r = route(x_TD, router_ED, top_k)
    plan = assign_slots(r.topi_Tk, num_experts,
                        capacity(num_tokens, num_experts, top_k, capacity_factor))
    slots = buffer_slots(num_tokens, num_experts, top_k, capacity_factor)
    buf_ECD = dispatch(x_TD, r.topi_Tk, plan, num_experts, slots)
    recv_PNCD = _exchange(buf_ECD.reshape(ep, n, slots, dim))
    rows_NXD = recv_PNCD.transpose(1, 0, 2, 3).reshape(n, ep * slots, dim)
    out_NXD = apply_experts(experts_local, rows_NXD, lora_scale)  # adapters: on their EP rank
    back_PNCD = _exchange(out_NXD.reshape(n, ep, slots, dim).transpose(1, 0, 2, 3))
    y_TD = combine(back_PNCD.reshape(num_experts, slots, dim), r.topi_Tk, r.gates_Tk, plan,
                   x_TD.dtype)
    return y_TD, aux_loss(r.probs_TE, r.topi_Tk)[None], z_loss(r.logits_TE)[None]


def moe_layer_sharded(params: dict, x_TD: jax.Array, *, mesh: Mesh, top_k: int,
                      capacity_factor: float | None, lora_scale: float = 1.0) -> ShardedMoEOut:
    """The MoE layer over ``mesh``: x_TD holds all ranks' tokens (rank r: the r-th block)."""
    ep = mesh.shape[EP]
    num_experts = params["router"]["weight"].shape[0]
    check_ep_size(ep_size=ep, num_experts=num_experts)
    if x_TD.shape[0] % mesh.size:
        raise ValueError(f"T={x_TD.shape[0]} tokens must split over W={mesh.size}")
    expert_specs = jax.tree.map(lambda _: P(EP), params["experts"])
    fn = jax.shard_map(
        lambda router, experts, x: _local_moe(router, experts, x, ep=ep, top_k=top_k,
                                              capacity_factor=capacity_factor,
                                              lora_scale=lora_scale),
        mesh=mesh,
        in_specs=(P(), expert_specs, RANKS),
        out_specs=(RANKS, RANKS, RANKS),
    )
    args = (params["router"]["weight"], params["experts"], x_TD)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), (P(), expert_specs, RANKS))
    return ShardedMoEOut(*fn(*jax.reshard(args, shardings)))  # Explicit mesh: place inputs


def moe_layer_per_slice(params: dict, x_TD: jax.Array, *, world_size: int, top_k: int,
                        capacity_factor: float | None, lora_scale: float = 1.0) -> ShardedMoEOut:
    """Unsharded twin: ``moe_layer`` on each of the W equal token slices, all experts local."""
    x_WTD = x_TD.reshape(world_size, x_TD.shape[0] // world_size, x_TD.shape[1])
    out = jax.vmap(lambda x: moe_layer(params, x, top_k=top_k, capacity_factor=capacity_factor,
                                       lora_scale=lora_scale))(x_WTD)
    return ShardedMoEOut(out.y_TD.reshape(x_TD.shape), out.aux, out.z)
