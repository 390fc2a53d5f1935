"""The dense MLP kind of the reference: one SwiGLU every token goes through, in the first
``first_k_dense`` layers in place of the MoE layer (DeepSeek-V3's ``first_k_dense_replace``).

Torch counterpart: ``torch_impl/model/dense.py``; semantics: docs/model.md ("Dense MLP
layers"). Params ``{"w1", "w3": {weight: [F, D]}, "w2": {weight: [D, F]}}`` at
``layers[i]["mlp"]``, FQNs ``layers.{i}.mlp.w1.weight``. Legend: T tokens, D model dim, F
hidden dim (``dense_ffn_dim``, default ``ffn_dim``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from moezero.reference.lora import linear, with_lora

if TYPE_CHECKING:
    from moezero.reference.model import ModelConfig


def init_dense(cfg: ModelConfig, key, std: float, out_std: float) -> dict:
    """Fresh params: ``w1``, ``w3`` N(0, std²), ``w2`` N(0, out_std²), with LoRA adapters where
    ``cfg`` targets ``mlp``."""
    d, f = cfg.dim, cfg.dense_hidden
    k = jax.random.split(key, 3)
    p = {"w1": {"weight": std * jax.random.normal(k[0], (f, d), jnp.float32)},
         "w3": {"weight": std * jax.random.normal(k[1], (f, d), jnp.float32)},
         "w2": {"weight": out_std * jax.random.normal(k[2], (d, f), jnp.float32)}}
    return with_lora(cfg, "mlp", p)


def dense_mlp(p: dict, x_TD: jax.Array, lora_scale: float = 1.0) -> jax.Array:
    """``w2(silu(w1 x) * w3 x)``."""
    h = jax.nn.silu(linear(p["w1"], x_TD, lora_scale)) * linear(p["w3"], x_TD, lora_scale)
    return linear(p["w2"], h, lora_scale)
