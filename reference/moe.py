"""Mixture-of-Experts layer: top-k router, capacity with drop order, SwiGLU experts, aux losses.

Torch counterpart: ``torch_impl/model/moe.py`` (layer), ``router.py`` (the router variants:
``route``, ``expert_load``, ``update_expert_bias``), ``dispatch.py`` (slots, dispatch, combine as a
permutation) and ``experts.py`` (grouped SwiGLU). Semantics: ``docs/model.md`` ("MoE layer",
"Router").

Every function is pure in (params, inputs). Experts are stacked along a leading global expert
axis (``w1_EFD``); ``moezero.reference.weights`` unstacks them into per-expert FQNs. The same dispatch
path serves both modes: dropless is capacity mode with ``C = T`` (no expert can receive more
than T assignments, because a token's k choices are distinct experts).

Shape legend: T tokens, D model dim, F expert hidden dim, E experts, k top-k choices,
C capacity (slots per expert), A = T·k assignments.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    """The router's decisions for T tokens (all fp32 / int32)."""

    logits_TE: jax.Array
    probs_TE: jax.Array
    topi_Tk: jax.Array  # expert index of each choice, best first (ties: lower index first)
    gates_Tk: jax.Array  # top-k probabilities renormalised to sum to 1 per token


class SlotPlan(NamedTuple):
    """Where each assignment (t, j) goes: expert ``topi_Tk``, slot ``slot_Tk`` if ``keep_Tk``."""

    keep_Tk: jax.Array
    slot_Tk: jax.Array


def acc_dtype(dtype):
    """fp32 for fp32/bf16/fp16 inputs; float64 stays float64 (finite-difference tests)."""
    return jnp.promote_types(dtype, jnp.float32)


def route(x_TD: jax.Array, router_ED: jax.Array, top_k: int, *, scoring: str = "softmax",
          renormalize: bool = True, bias_E: jax.Array | None = None,
          logit_bias_E: jax.Array | None = None, groups: tuple[int, int] = (1, 1),
          scale: float = 1.0) -> Routing:
    """Router logits in fp32 (x and W upcast), scores, top-k and gates (docs/model.md).

    Scores are ``softmax`` over experts or a ``sigmoid`` per expert. The top-k choice ranks
    ``scores + bias_E`` (the aux-loss-free expert bias; ties: lower index first) among the
    experts of the best groups (``groups`` = (n_group, topk_group): ``limit_to_groups``); the
    gates are the chosen experts' unbiased scores, renormalised to sum 1 (Mixtral) or not,
    times ``scale`` (``routed_scaling_factor``). ``probs_TE`` (the aux loss's P) is the scores
    normalised per token. ``topk_softmax`` (gpt-oss): the top-k of the logits (plus
    ``bias_E``), gated by a softmax over those k; P the softmax over all. ``logit_bias_E``: the
    router's own bias, added to the logits (gpt-oss).
    """
    f32 = acc_dtype(x_TD.dtype)
    logits_TE = x_TD.astype(f32) @ router_ED.astype(f32).T
    if logit_bias_E is not None:
        logits_TE = logits_TE + logit_bias_E.astype(f32)
    if scoring == "topk_softmax":
        choice_TE = logits_TE if bias_E is None else logits_TE + jax.lax.stop_gradient(bias_E)
        _, topi_Tk = jax.lax.top_k(choice_TE, top_k)
        gates_Tk = jax.nn.softmax(jnp.take_along_axis(logits_TE, topi_Tk, axis=-1), axis=-1)
        return Routing(logits_TE, jax.nn.softmax(logits_TE, axis=-1), topi_Tk, gates_Tk)
    if scoring == "softmax":
        scores_TE = jax.nn.softmax(logits_TE, axis=-1)
    else:
        scores_TE = jax.nn.sigmoid(logits_TE)
    choice_TE = scores_TE if bias_E is None else scores_TE + jax.lax.stop_gradient(bias_E)
    if groups[0] > 1:
        choice_TE = limit_to_groups(choice_TE, *groups)
    _, topi_Tk = jax.lax.top_k(choice_TE, top_k)  # ties: lower index first (documented)
    topv_Tk = jnp.take_along_axis(scores_TE, topi_Tk, axis=-1)
    gates_Tk = topv_Tk / jnp.sum(topv_Tk, axis=-1, keepdims=True) if renormalize else topv_Tk
    if scale != 1.0:
        gates_Tk = gates_Tk * scale
    probs_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True) \
        if scoring == "sigmoid" else scores_TE
    return Routing(logits_TE, probs_TE, topi_Tk, gates_Tk)


def limit_to_groups(choice_TE: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """Group-limited choice (DeepSeek-V3's noaux_tc): experts in ``n_group`` consecutive groups,
    a group's score the sum of its two best choice scores; experts outside the ``topk_group``
    best groups (ties: lower group first) get -inf."""
    num_tokens, num_experts = choice_TE.shape
    grouped_TGe = choice_TE.reshape(num_tokens, n_group, num_experts // n_group)
    group_TG = jnp.sum(jax.lax.top_k(grouped_TGe, 2)[0], axis=-1)
    _, best_Tg = jax.lax.top_k(group_TG, topk_group)
    keep_TG = jnp.sum(jax.nn.one_hot(best_Tg, n_group, dtype=jnp.int32), axis=1) > 0
    return jnp.where(keep_TG[..., None], grouped_TGe, -jnp.inf).reshape(choice_TE.shape)


def expert_load(topi_Tk: jax.Array, num_experts: int) -> jax.Array:
    """Assignments per expert (int32 [E]) before capacity drops: the load the bias balances."""
    return jnp.sum(jax.nn.one_hot(topi_Tk, num_experts, dtype=jnp.int32), axis=(0, 1))


def update_expert_bias(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's aux-loss-free update: ``bias_e + rate · sign(mean load − load_e)``, the
    sign taken exactly in integers as ``sign(Σ load − E · load_e)``."""
    sign_E = jnp.sign(jnp.sum(load_E) - load_E.shape[0] * load_E).astype(bias_E.dtype)
    return bias_E + rate * sign_E


def aux_loss(probs_TE: jax.Array, topi_Tk: jax.Array) -> jax.Array:
    """Switch/GShard load balancing: ``E · Σ_e f_e · P_e``; f counts choices before drops."""
    num_tokens, num_experts = probs_TE.shape
    counts_E = jnp.sum(jax.nn.one_hot(topi_Tk, num_experts, dtype=probs_TE.dtype), axis=(0, 1))
    f_E = jax.lax.stop_gradient(counts_E / (num_tokens * topi_Tk.shape[1]))
    p_E = jnp.mean(probs_TE, axis=0)
    return num_experts * jnp.sum(f_E * p_E)


def z_loss(logits_TE: jax.Array) -> jax.Array:
    """ST-MoE router z-loss: ``mean_T logsumexp(logits)²``."""
    return jnp.mean(jax.nn.logsumexp(logits_TE, axis=-1) ** 2)


def capacity(num_tokens: int, num_experts: int, top_k: int,
             capacity_factor: float | None) -> int | None:
    """Slots per expert, ``ceil(cf · T · k / E)``; None when dropless."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def buffer_slots(num_tokens: int, num_experts: int, top_k: int,
                 capacity_factor: float | None) -> int:
    """Rows per expert in the dispatch buffer: the capacity, never more than T (all fit)."""
    cap = capacity(num_tokens, num_experts, top_k, capacity_factor)
    return num_tokens if cap is None else min(cap, num_tokens)


def assign_slots(topi_Tk: jax.Array, num_experts: int, cap: int | None) -> SlotPlan:
    """Rank assignments choice-major (all first choices by token, then all second, …).

    An assignment's slot is the number of earlier assignments to the same expert in that
    order; it is kept iff its slot < capacity (every assignment is kept when ``cap`` is None).
    """
    num_tokens, top_k = topi_Tk.shape
    topi_A = topi_Tk.T.reshape(-1)  # choice-major: a = j·T + t
    onehot_AE = jax.nn.one_hot(topi_A, num_experts, dtype=jnp.int32)
    before_AE = jnp.cumsum(onehot_AE, axis=0) - onehot_AE
    slot_A = jnp.sum(before_AE * onehot_AE, axis=-1)
    slot_Tk = slot_A.reshape(top_k, num_tokens).T
    keep_Tk = jnp.ones_like(slot_Tk, bool) if cap is None else slot_Tk < cap
    return SlotPlan(keep_Tk, slot_Tk)


def dispatch(x_TD: jax.Array, topi_Tk: jax.Array, plan: SlotPlan, num_experts: int,
             slots: int) -> jax.Array:
    """Scatter kept token rows into an [E, C, D] buffer; empty slots stay zero."""
    slot_Tk = jnp.where(plan.keep_Tk, plan.slot_Tk, slots)  # dropped → out of range → discarded
    rows_TkD = jnp.broadcast_to(x_TD[:, None, :], (*topi_Tk.shape, x_TD.shape[-1]))
    buf_ECD = jnp.zeros((num_experts, slots, x_TD.shape[-1]), x_TD.dtype)
    return buf_ECD.at[topi_Tk, slot_Tk].set(rows_TkD, mode="drop")


def combine(out_ECD: jax.Array, topi_Tk: jax.Array, gates_Tk: jax.Array,
            plan: SlotPlan, out_dtype) -> jax.Array:
    """``y_t = Σ_{kept j} gate_tj · out[topi_tj, slot_tj]``, accumulated in fp32."""
    slot_Tk = jnp.where(plan.keep_Tk, plan.slot_Tk, 0)
    rows_TkD = out_ECD[topi_Tk, slot_Tk].astype(acc_dtype(out_ECD.dtype))
    weight_Tk = jnp.where(plan.keep_Tk, gates_Tk, 0.0)  # dropped: contributes nothing
    return jnp.einsum("tk,tkd->td", weight_Tk, rows_TkD).astype(out_dtype)


def swiglu(w1_FD: jax.Array, w3_FD: jax.Array, w2_DF: jax.Array, x_ND: jax.Array) -> jax.Array:
    """One expert: ``w2(silu(w1 x) * w3 x)`` in the input dtype (torch Linear layout)."""
    return (jax.nn.silu(x_ND @ w1_FD.T) * (x_ND @ w3_FD.T)) @ w2_DF.T


def gated(h1: jax.Array, h3: jax.Array, limit: float | None, alpha: float) -> jax.Array:
    """``silu(h1) · h3``, or with ``limit`` gpt-oss's clamped SwiGLU: ``g = min(h1, limit)``,
    ``(clip(h3, ±limit) + 1) · g · sigmoid(alpha · g)``."""
    if limit is None:
        return jax.nn.silu(h1) * h3
    g = jnp.minimum(h1, limit)
    return (jnp.clip(h3, -limit, limit) + 1) * (g * jax.nn.sigmoid(g * alpha))


def apply_experts(experts: dict, x_ECD: jax.Array, lora_scale: float = 1.0,
                  limit: float | None = None, alpha: float = 1.702) -> jax.Array:
    """Run expert e on row block e: stacked params ``{w1: [E,F,D], w3: [E,F,D], w2: [E,D,F]}``,
    each with a ``bias`` [E, out] where the experts have biases; with LoRA adapters
    (``lora_A`` [E,R,in], ``lora_B`` [E,out,R] on a projection) each expert's projection adds
    ``lora_scale · (x A_e^T) B_e^T`` (torch: the grouped GEMMs of ``moezero.model.experts``);
    ``limit``/``alpha``: ``gated``'s."""
    plain = not any(k in experts[name] for name in ("w1", "w3", "w2") for k in ("lora_A", "bias"))
    if plain and limit is None:
        w = {name: experts[name]["weight"] for name in ("w1", "w3", "w2")}
        return jax.vmap(swiglu)(w["w1"], w["w3"], w["w2"], x_ECD)

    def one(p: dict, x_CD: jax.Array) -> jax.Array:
        def proj(q, x):
            y = x @ q["weight"].T
            y = y + q["bias"] if "bias" in q else y
            return y + lora_scale * ((x @ q["lora_A"].T) @ q["lora_B"].T) if "lora_A" in q else y
        return proj(p["w2"], gated(proj(p["w1"], x_CD), proj(p["w3"], x_CD), limit, alpha))
    return jax.vmap(one)({n: experts[n] for n in ("w1", "w3", "w2")}, x_ECD)


class MoEOut(NamedTuple):
    y_TD: jax.Array
    aux: jax.Array  # load-balancing loss of this call's tokens (scalar fp32)
    z: jax.Array  # router z-loss (scalar fp32)
    routing: Routing
    plan: SlotPlan


def moe_layer(params: dict, x_TD: jax.Array, *, top_k: int,
              capacity_factor: float | None, scoring: str = "softmax",
              renormalize: bool = True, lora_scale: float = 1.0,
              limit: float | None = None, alpha: float = 1.702,
              groups: tuple[int, int] = (1, 1), scale: float = 1.0) -> MoEOut:
    """The MoE layer on one rank's T tokens: ``params = {router: {weight[, bias][,
    expert_bias]}, experts: {...}}``; the router variant is ``scoring``/``renormalize``/
    ``groups``/``scale`` (see ``route``), the experts' activation ``limit``/``alpha`` (see
    ``gated``)."""
    num_tokens = x_TD.shape[0]
    num_experts = params["router"]["weight"].shape[0]
    r = route(x_TD, params["router"]["weight"], top_k, scoring=scoring, renormalize=renormalize,
              bias_E=params["router"].get("expert_bias"),
              logit_bias_E=params["router"].get("bias"), groups=groups, scale=scale)
    cap = capacity(num_tokens, num_experts, top_k, capacity_factor)
    plan = assign_slots(r.topi_Tk, num_experts, cap)
    slots = buffer_slots(num_tokens, num_experts, top_k, capacity_factor)
    buf_ECD = dispatch(x_TD, r.topi_Tk, plan, num_experts, slots)
    out_ECD = apply_experts(params["experts"], buf_ECD, lora_scale, limit, alpha)
    y_TD = combine(out_ECD, r.topi_Tk, r.gates_Tk, plan, x_TD.dtype)
    return MoEOut(y_TD, aux_loss(r.probs_TE, r.topi_Tk), z_loss(r.logits_TE), r, plan)
