"""The MoE MLP kind of the reference: the routed experts (``reference/moe.py: moe_layer``,
at ``layers[i]["moe"]``) plus the optional always-on shared expert (``layers[i]["shared"]``),
summed. Torch counterpart: ``torch_impl/model/moe_mlp.py`` (with ``moe.py`` and
``shared.py``); semantics: docs/model.md ("MoE layer", "Shared expert").
Legend: T tokens, D model dim, F expert hidden dim, E experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from moezero.reference.lora import linear
from moezero.reference.lora import with_lora as _with_lora
from moezero.reference.moe import moe_layer

if TYPE_CHECKING:
    from moezero.reference.model import ModelConfig


def _normal(key, shape, std):
    return std * jax.random.normal(key, shape, jnp.float32)


def _init_shared(cfg: ModelConfig, key, std: float, out_std: float) -> dict:
    d, f = cfg.dim, cfg.shared_ffn_dim
    k = jax.random.split(key, 4)
    p = {"w1": {"weight": _normal(k[0], (f, d), std)}, "w3": {"weight": _normal(k[1], (f, d), std)},
         "w2": {"weight": _normal(k[2], (d, f), out_std)}}
    p = _with_lora(cfg, "shared", p)
    return {**p, "gate": {"weight": _normal(k[3], (1, d), std)}} if cfg.shared_gate else p


def init_moe_mlp(cfg: ModelConfig, k, std: float, out_std: float) -> dict:
    """The MoE kind's params: ``moe`` (router, experts stacked on E) and the optional
    ``shared`` expert; ``k`` the layer's keys 1..5."""
    d, f, e = cfg.dim, cfg.ffn_dim, cfg.num_experts
    router = {"weight": _normal(k[1], (e, d), std)}
    if cfg.router_bias:
        router["bias"] = jnp.zeros((e,), jnp.float32)
    if cfg.expert_bias:
        router["expert_bias"] = jnp.zeros((e,), jnp.float32)
    mlp = {"moe": {
        "router": router,
        "experts": _with_lora(cfg, "experts", _expert_biases(cfg, {
            "w1": {"weight": _normal(k[2], (e, f, d), std)},
            "w3": {"weight": _normal(k[3], (e, f, d), std)},
            "w2": {"weight": _normal(k[4], (e, d, f), out_std)},
        }), (e,)),
    }}
    if cfg.shared_ffn_dim:
        mlp["shared"] = _init_shared(cfg, k[5], std, out_std)
    return mlp


def _expert_biases(cfg: ModelConfig, experts: dict) -> dict:
    """Zero biases [E, out] on each projection with ``cfg.expert_mlp_bias`` (gpt-oss)."""
    if not cfg.expert_mlp_bias:
        return experts
    return {n: {**p, "bias": jnp.zeros(p["weight"].shape[:2], jnp.float32)}
            for n, p in experts.items()}


def shared_expert(p: dict, x: jax.Array, lora_scale: float = 1.0) -> jax.Array:
    """The always-on SwiGLU ``w2(silu(w1 x) * w3 x)``, times ``sigmoid(x · gate)`` if gated."""
    h = jax.nn.silu(linear(p["w1"], x, lora_scale)) * linear(p["w3"], x, lora_scale)
    y = linear(p["w2"], h, lora_scale)
    return y if "gate" not in p else jax.nn.sigmoid(x @ p["gate"]["weight"].T) * y


def moe_mlp(layer: dict, x_TD: jax.Array, cfg: ModelConfig):
    """The MoE kind (torch: ``moezero.model.moe_mlp``): the routed experts plus the optional
    shared expert; returns (y_TD, the ``moe_layer`` output with its aux, z and routing)."""
    out = moe_layer(layer["moe"], x_TD, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
                    scoring=cfg.router_scoring, renormalize=cfg.renormalize,
                    lora_scale=cfg.lora_scale, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha,
                    groups=(cfg.n_group, cfg.topk_group), scale=cfg.routed_scaling_factor)
    if "shared" not in layer:
        return out.y_TD, out
    return out.y_TD + shared_expert(layer["shared"], x_TD, cfg.lora_scale), out
