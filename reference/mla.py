"""Multi-head latent attention in the reference (``ModelConfig.attention == "mla"``): keys and
values expanded from one RMS-normed latent per token, one rotary key part shared by all heads,
queries direct or through their own normed latent (DeepSeek-V3).

Torch counterpart: ``torch_impl/model/mla.py``; semantics: docs/model.md ("Multi-head latent
attention"). Params at ``layers[i]["attn"]`` under transformers' module names: ``q_proj``
(without ``q_lora_rank``) or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``; then
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj`` (biases on ``q_a_proj``,
``kv_a_proj_with_mqa`` and ``o_proj`` with ``attn_bias: all``). Legend: B batch, S sequence,
D model dim, H heads, N non-rotary dims, R rotary dims, V value dims, C latent rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from moezero.reference.lora import linear, with_lora
from moezero.reference.moe import acc_dtype

if TYPE_CHECKING:
    from moezero.reference.model import ModelConfig
    from moezero.reference.packing import DocumentLayout

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, not rms_norm_eps


def _linear(key, out_dim: int, in_dim: int, std: float, bias: bool) -> dict:
    p = {"weight": std * jax.random.normal(key, (out_dim, in_dim), jnp.float32)}
    return {**p, "bias": jnp.zeros((out_dim,), jnp.float32)} if bias else p


def init_mla(cfg: ModelConfig, key, std: float, out_std: float) -> dict:
    """Fresh params: projections N(0, std²), ``o_proj`` N(0, out_std²), latent norm gains 1,
    biases 0; LoRA adapters where ``cfg`` targets ``attn``."""
    d, h, bias = cfg.dim, cfg.n_heads, cfg.attn_bias == "all"
    n, r, v, c = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    k = jax.random.split(key, 5)
    if cfg.q_lora_rank is None:
        p = {"q_proj": _linear(k[0], h * (n + r), d, std, False)}
    else:
        p = {"q_a_proj": _linear(k[0], cfg.q_lora_rank, d, std, bias),
             "q_a_layernorm": {"weight": jnp.ones((cfg.q_lora_rank,), jnp.float32)},
             "q_b_proj": _linear(k[1], h * (n + r), cfg.q_lora_rank, std, False)}
    p.update({"kv_a_proj_with_mqa": _linear(k[2], c + r, d, std, bias),
              "kv_a_layernorm": {"weight": jnp.ones((c,), jnp.float32)},
              "kv_b_proj": _linear(k[3], h * (n + v), c, std, False),
              "o_proj": _linear(k[4], d, h * v, out_std, bias)})
    return with_lora(cfg, "attn", p)


def _queries(p: dict, x_BSD: jax.Array, cfg: ModelConfig) -> jax.Array:
    from moezero.reference.model import rmsnorm  # model.py imports this module

    if "q_proj" in p:
        return linear(p["q_proj"], x_BSD, cfg.lora_scale)
    latent = rmsnorm(linear(p["q_a_proj"], x_BSD, cfg.lora_scale), p["q_a_layernorm"]["weight"],
                     LATENT_NORM_EPS)
    return linear(p["q_b_proj"], latent, cfg.lora_scale)


def _rotate(x_BSHR: jax.Array, cfg: ModelConfig, docs: DocumentLayout | None) -> jax.Array:
    """RoPE on the rotary dims, de-interleaved first with ``rope_interleave`` (pairs (x0, x1),
    (x2, x3), ... become halves [x0, x2, ... | x1, x3, ...])."""
    from moezero.reference.model import apply_rope, rope_tables, rope_tables_at

    if cfg.rope_interleave:
        x_BSHR = jnp.concatenate([x_BSHR[..., 0::2], x_BSHR[..., 1::2]], -1)
    s, r = x_BSHR.shape[1], x_BSHR.shape[-1]
    cos, sin = rope_tables(s, r, cfg.rope_theta, cfg) if docs is None else \
        rope_tables_at(docs.positions_BS, r, cfg.rope_theta, cfg)  # with YaRN where set
    return apply_rope(x_BSHR, cos, sin)


def mla_attention(p: dict, x_BSD: jax.Array, cfg: ModelConfig,
                  docs: DocumentLayout | None = None) -> jax.Array:
    """Causal latent attention; scores ``q·k · (N+R)^-1/2 · mla_mscale²`` and softmax in fp32.
    With ``docs``: each query reads only its own document, rotary positions restarting per
    document."""
    from moezero.reference.model import rmsnorm

    b, s, _ = x_BSD.shape
    h, n, r, v = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q_BSHQ = _queries(p, x_BSD, cfg).reshape(b, s, h, n + r)
    kv_a = linear(p["kv_a_proj_with_mqa"], x_BSD, cfg.lora_scale)
    c_BSC, k_rot_BSR = kv_a[..., :cfg.kv_lora_rank], kv_a[..., cfg.kv_lora_rank:]
    c_BSC = rmsnorm(c_BSC, p["kv_a_layernorm"]["weight"], LATENT_NORM_EPS)
    kv_BSHX = linear(p["kv_b_proj"], c_BSC, cfg.lora_scale).reshape(b, s, h, n + v)
    q_rot_BSHR = _rotate(q_BSHQ[..., n:], cfg, docs)
    k_rot_BS1R = _rotate(k_rot_BSR[:, :, None, :], cfg, docs)
    q_BSHQ = jnp.concatenate([q_BSHQ[..., :n], q_rot_BSHR], -1)
    k_BSHQ = jnp.concatenate([kv_BSHX[..., :n], jnp.broadcast_to(k_rot_BS1R, (b, s, h, r))], -1)
    scale = (n + r) ** -0.5 * cfg.mla_mscale ** 2
    scores_BHSS = jnp.einsum("bqhk,bshk->bhqs", q_BSHQ, k_BSHQ,
                             preferred_element_type=acc_dtype(x_BSD.dtype)) * scale
    allowed = jnp.tril(jnp.ones((s, s), bool)) if docs is None else docs.allowed_BSS[:, None]
    probs_BHSS = jax.nn.softmax(jnp.where(allowed, scores_BHSS, -jnp.inf), axis=-1)
    out_BSHV = jnp.einsum("bhqs,bshv->bqhv", probs_BHSS.astype(x_BSD.dtype), kv_BSHX[..., n:])
    return linear(p["o_proj"], out_BSHV.reshape(b, s, h * v), cfg.lora_scale)
