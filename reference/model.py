"""Mixtral-style MoE decoder: RMSNorm, half-split RoPE, causal attention, MoE FFN, loss.

Torch counterpart: ``torch_impl/model/decoder.py`` (the MoE layer: ``reference/moe.py`` ↔
``torch_impl/model/moe.py``). Semantics: ``docs/model.md``.

Params are a plain nested dict mirroring the FQNs, with experts stacked on a leading global
expert axis (``layers[i]["moe"]["experts"]["w1"]["weight"]`` is [E, F, D]); see
``reference/weights.py`` for the exchange by FQN. Everything here is a pure function.

Precision: ``dtype`` is the compute dtype. Params are cast to it on entry (the compute copy of
fp32 masters); RMSNorm, the attention softmax, the router and the loss run in fp32.

Shape legend: B batch, S sequence, T tokens (B·S, row-major over (b, s)), D model dim,
H heads, K head dim (D/H), F expert hidden dim, E experts, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moezero.reference.moe import acc_dtype, moe_layer


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model hyperparameters (``model.*`` / ``moe.*`` config keys). Hashable: jit-static."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 128
    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float | None = None  # None = dropless
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    def __post_init__(self):
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim={self.dim} must split into n_heads={self.n_heads} even heads")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0 or None")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# ---------------------------------------------------------------------------------------- init


def _normal(key, shape, std):
    return std * jax.random.normal(key, shape, jnp.float32)


def _init_layer(cfg: ModelConfig, key) -> dict:
    d, f, e = cfg.dim, cfg.ffn_dim, cfg.num_experts
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)
    k = jax.random.split(key, 8)
    return {
        "attn_norm": {"weight": jnp.ones((d,), jnp.float32)},
        "attn": {
            "wq": {"weight": _normal(k[0], (d, d), std)},
            "wk": {"weight": _normal(k[1], (d, d), std)},
            "wv": {"weight": _normal(k[2], (d, d), std)},
            "wo": {"weight": _normal(k[3], (d, d), out_std)},
        },
        "ffn_norm": {"weight": jnp.ones((d,), jnp.float32)},
        "moe": {
            "router": {"weight": _normal(k[4], (e, d), std)},
            "experts": {
                "w1": {"weight": _normal(k[5], (e, f, d), std)},
                "w3": {"weight": _normal(k[6], (e, f, d), std)},
                "w2": {"weight": _normal(k[7], (e, d, f), out_std)},
            },
        },
    }


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Fresh fp32 params (docs/model.md init): N(0, 0.02); wo, w2 N(0, 0.02/sqrt(2L)); gains 1."""
    k_embed, k_head, *k_layers = jax.random.split(key, cfg.n_layers + 2)
    return {
        "embed": {"weight": _normal(k_embed, (cfg.vocab_size, cfg.dim), 0.02)},
        "layers": [_init_layer(cfg, k) for k in k_layers],
        "norm": {"weight": jnp.ones((cfg.dim,), jnp.float32)},
        "lm_head": {"weight": _normal(k_head, (cfg.vocab_size, cfg.dim), 0.02)},
    }


# ------------------------------------------------------------------------------------- blocks


def rmsnorm(x: jax.Array, gain_D: jax.Array, eps: float) -> jax.Array:
    """``x · rsqrt(mean(x², -1) + eps) · g`` in fp32, cast back to x's dtype."""
    x32 = x.astype(acc_dtype(x.dtype))
    out = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (out * gain_D.astype(x32.dtype)).astype(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """fp32 ``cos, sin`` of shape [S, K/2]: angle = pos · theta^(-2j/K), pos = 0..S-1."""
    half = head_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # as torch_impl computes it
    angle_SK2 = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angle_SK2), jnp.sin(angle_SK2)


def apply_rope(x_BSHK: jax.Array, cos_SK2: jax.Array, sin_SK2: jax.Array) -> jax.Array:
    """Half-split rotation (HF ``rotate_half``), computed in fp32, cast back to x's dtype."""
    x32 = x_BSHK.astype(acc_dtype(x_BSHK.dtype))
    half = x32.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    cos, sin = cos_SK2[None, :, None, :], sin_SK2[None, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BSHK.dtype)


def attention(p: dict, x_BSD: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Causal multi-head attention with RoPE; scores and softmax in fp32."""
    b, s, d = x_BSD.shape
    h, k = cfg.n_heads, cfg.head_dim
    q_BSHK = (x_BSD @ p["wq"]["weight"].T).reshape(b, s, h, k)
    k_BSHK = (x_BSD @ p["wk"]["weight"].T).reshape(b, s, h, k)
    v_BSHK = (x_BSD @ p["wv"]["weight"].T).reshape(b, s, h, k)
    cos, sin = rope_tables(s, k, cfg.rope_theta)
    q_BSHK, k_BSHK = apply_rope(q_BSHK, cos, sin), apply_rope(k_BSHK, cos, sin)
    scores_BHSS = jnp.einsum("bqhk,bshk->bhqs", q_BSHK, k_BSHK,
                             preferred_element_type=acc_dtype(x_BSD.dtype)) / math.sqrt(k)
    causal_SS = jnp.tril(jnp.ones((s, s), bool))
    scores_BHSS = jnp.where(causal_SS, scores_BHSS, -jnp.inf)
    probs_BHSS = jax.nn.softmax(scores_BHSS, axis=-1).astype(x_BSD.dtype)
    out_BSD = jnp.einsum("bhqs,bshk->bqhk", probs_BHSS, v_BSHK).reshape(b, s, d)
    return out_BSD @ p["wo"]["weight"].T


class ForwardOut(NamedTuple):
    logits_BSV: jax.Array  # compute dtype
    aux_L: jax.Array  # per-layer load-balancing loss, fp32, unweighted
    z_L: jax.Array  # per-layer router z-loss, fp32, unweighted


def cast_params(params, dtype):
    """The compute copy: every leaf cast to ``dtype`` (fp32 masters stay untouched)."""
    return jax.tree.map(lambda a: a.astype(dtype), params)


def forward_with_stats(params: dict, tokens_BS: jax.Array, cfg: ModelConfig, *,
                       dtype=jnp.float32) -> ForwardOut:
    """The decoder on one rank's batch; the MoE sees the B·S tokens of this call as T."""
    p = cast_params(params, dtype)
    h_BSD = p["embed"]["weight"][tokens_BS]
    b, s, d = h_BSD.shape
    aux, z = [], []
    for layer in p["layers"]:
        h_BSD = h_BSD + attention(layer["attn"], rmsnorm(h_BSD, layer["attn_norm"]["weight"],
                                                         cfg.norm_eps), cfg)
        x_TD = rmsnorm(h_BSD, layer["ffn_norm"]["weight"], cfg.norm_eps).reshape(b * s, d)
        out = moe_layer(layer["moe"], x_TD, top_k=cfg.top_k,
                        capacity_factor=cfg.capacity_factor)
        h_BSD = h_BSD + out.y_TD.reshape(b, s, d)
        aux.append(out.aux)
        z.append(out.z)
    logits_BSV = rmsnorm(h_BSD, p["norm"]["weight"], cfg.norm_eps) @ p["lm_head"]["weight"].T
    return ForwardOut(logits_BSV, jnp.stack(aux), jnp.stack(z))


def weighted_aux(aux_L: jax.Array, z_L: jax.Array, cfg: ModelConfig) -> jax.Array:
    """``Σ_layers (aux_coef·aux + z_coef·z)``: the MoE term of the total loss."""
    return cfg.aux_loss_coef * jnp.sum(aux_L) + cfg.z_loss_coef * jnp.sum(z_L)


def forward(params: dict, tokens_BS: jax.Array, cfg: ModelConfig, *,
            dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Logits [B, S, V] and the weighted MoE loss term ``Σ (aux_coef·aux + z_coef·z)``."""
    out = forward_with_stats(params, tokens_BS, cfg, dtype=dtype)
    return out.logits_BSV, weighted_aux(out.aux_L, out.z_L, cfg)


# --------------------------------------------------------------------------------------- loss


def cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
    """Mean token cross-entropy over all B·S targets, in fp32."""
    logits = logits_BSV.astype(acc_dtype(logits_BSV.dtype))
    picked_BS = jnp.take_along_axis(logits, targets_BS[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked_BS)


def loss_fn(params: dict, batch_BS1: jax.Array, cfg: ModelConfig, *,
            dtype=jnp.float32) -> tuple[jax.Array, dict]:
    """One rank's loss on a [B, S+1] token batch: ``ce + Σ_l (aux_coef·aux + z_coef·z)``.

    Metrics: ``loss``; ``ce``; ``aux_loss``, the weighted MoE term added to ce (as torch_impl
    reports it); ``lb_loss`` and ``z_loss``, the unweighted sums over layers of aux and z.
    """
    out = forward_with_stats(params, batch_BS1[:, :-1], cfg, dtype=dtype)
    ce = cross_entropy(out.logits_BSV, batch_BS1[:, 1:])
    aux_total = weighted_aux(out.aux_L, out.z_L, cfg)
    return ce + aux_total, {"loss": ce + aux_total, "ce": ce, "aux_loss": aux_total,
                            "lb_loss": jnp.sum(out.aux_L), "z_loss": jnp.sum(out.z_L)}


def split_batch(global_batch: jax.Array, world_size: int) -> jax.Array:
    """[W·b, ...] → [W, b, ...]: rank r owns the contiguous rows ``[r·b, (r+1)·b)``."""
    n = global_batch.shape[0]
    if n % world_size:
        raise ValueError(f"global batch of {n} rows does not split over {world_size} ranks")
    return global_batch.reshape(world_size, n // world_size, *global_batch.shape[1:])


def oracle_loss(params: dict, global_batch: jax.Array, cfg: ModelConfig, world_size: int, *,
                dtype=jnp.float32) -> tuple[jax.Array, dict]:
    """What a W-rank data-parallel run optimises: the mean over ranks of each rank's loss_fn.

    Each rank's slice is routed on its own (capacity, aux and z are per rank, DESIGN.md §2).
    """
    slices_WBS1 = split_batch(global_batch, world_size)
    _, metrics_W = jax.vmap(lambda b: loss_fn(params, b, cfg, dtype=dtype))(slices_WBS1)
    metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics_W)
    return metrics["loss"], metrics
