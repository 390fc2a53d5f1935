"""The gated DeltaNet attention kind of the reference, in its recurrent form: one token at a
time, the oracle of torch's chunked rule.

Torch counterpart: ``torch_impl/model/gated_delta.py`` (``GatedDeltaNet``, chunked);
semantics: docs/model.md ("Gated DeltaNet"). Params at ``layers[i]["linear_attn"]`` under
the checkpoint's names: ``in_proj_qkvz``, ``in_proj_ba``, ``conv1d`` ({weight: [C, 1, W]}),
``dt_bias``, ``A_log`` ([H]), ``norm`` ({weight: [V]}), ``out_proj``. With a document layout
the state and the convolution window restart at each document's first token.
Legend: B batch, S sequence, D model dim, C conv channels, W conv window, G key heads,
H value heads, K key head dim, V value head dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from moezero.reference.lora import linear, with_lora
from moezero.reference.packing import DocumentLayout

if TYPE_CHECKING:
    from moezero.reference.model import ModelConfig


def init_gated_delta(cfg: ModelConfig, key, std: float, out_std: float) -> dict:
    """``{"linear_attn": fresh params}``: projections and conv N(0, std²) (``out_proj``
    out_std), ``dt_bias`` 1, ``A_log`` 0 (decay rate 1), norm gain 1; LoRA where ``cfg``
    targets ``linear_attn``."""
    d, g, h = cfg.dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    k_dim, v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    channels = 2 * g * k_dim + h * v_dim
    keys = jax.random.split(key, 4)
    normal = lambda k, shape, s: s * jax.random.normal(k, shape, jnp.float32)
    p = {"in_proj_qkvz": {"weight": normal(keys[0], (2 * g * k_dim + 2 * h * v_dim, d), std)},
         "in_proj_ba": {"weight": normal(keys[1], (2 * h, d), std)},
         "conv1d": {"weight": normal(keys[2], (channels, 1, cfg.linear_conv_kernel_dim), std)},
         "dt_bias": jnp.ones((h,), jnp.float32), "A_log": jnp.zeros((h,), jnp.float32),
         "norm": {"weight": jnp.ones((v_dim,), jnp.float32)},
         "out_proj": {"weight": normal(keys[3], (d, h * v_dim), out_std)}}
    return {"linear_attn": with_lora(cfg, "linear_attn", p)}


def _split(p: dict, x_BSD: jax.Array, cfg: ModelConfig, scale: float):
    """(qkv [B, S, C] before the conv, z [B, S, H, V], b, a [B, S, H]): per key head the
    checkpoint holds q, k, its value heads' v, z (and b, a)."""
    b, s, _ = x_BSD.shape
    g, h = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    k_dim, v_dim, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, h // g
    qkvz = linear(p["in_proj_qkvz"], x_BSD, scale).reshape(b, s, g, -1)
    bounds = [k_dim, 2 * k_dim, 2 * k_dim + r * v_dim]
    q, k, v, z = jnp.split(qkvz, bounds, axis=-1)
    beta, a = jnp.split(linear(p["in_proj_ba"], x_BSD, scale).reshape(b, s, g, 2 * r), [r], -1)
    qkv = jnp.concatenate([q.reshape(b, s, -1), k.reshape(b, s, -1), v.reshape(b, s, -1)], -1)
    return qkv, z.reshape(b, s, h, v_dim), beta.reshape(b, s, h), a.reshape(b, s, h)


def causal_conv(x_BSC: jax.Array, w_CW: jax.Array,
                positions_BS: jax.Array | None) -> jax.Array:
    """``out_t = Σ_j w[:, W-1-j] x_{t-j}``, terms before the row or the document taken as 0."""
    s, window = x_BSC.shape[1], w_CW.shape[-1]
    pos = jnp.arange(s)[None] if positions_BS is None else positions_BS
    out = jnp.zeros_like(x_BSC)
    for j in range(window):
        shifted = jnp.pad(x_BSC, ((0, 0), (j, 0), (0, 0)))[:, :s]
        out = out + jnp.where((pos >= j)[..., None], shifted, 0.0) * w_CW[:, window - 1 - j]
    return out


def recurrent_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, starts_BS) -> jax.Array:
    """The gated delta rule token by token: ``S = exp(g) S`` (0 at a document start), then
    ``S += k (beta (v - S^T k))^T`` and ``o = S^T q``. Returns o [B, S, H, V]."""
    b, _, h, k_dim = q_BSHK.shape

    def step(state_BHKV, xs):
        q, k, v, g, beta, start = xs
        state_BHKV = state_BHKV * jnp.where(start[:, None], 0.0, jnp.exp(g))[..., None, None]
        delta_BHV = (v - jnp.einsum("bhkv,bhk->bhv", state_BHKV, k)) * beta[..., None]
        state_BHKV = state_BHKV + k[..., :, None] * delta_BHV[..., None, :]
        return state_BHKV, jnp.einsum("bhkv,bhk->bhv", state_BHKV, q)

    xs = tuple(jnp.moveaxis(t, 1, 0) for t in (q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, starts_BS))
    state = jnp.zeros((b, h, k_dim, v_BSHV.shape[-1]), jnp.float32)
    return jnp.moveaxis(jax.lax.scan(step, state, xs)[1], 0, 1)


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)


def gated_rmsnorm(o: jax.Array, z: jax.Array, gain_V: jax.Array, eps: float) -> jax.Array:
    """``rmsnorm(o) * gain * silu(z)``, the norm in fp32, cast back to o's dtype."""
    o32 = o.astype(jnp.float32)
    normed = (o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, -1, keepdims=True) + eps)).astype(o.dtype)
    return (gain_V * normed * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


def query_rows(q_BSF: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The query rows of ``wq``'s output: with ``cfg.attn_output_gate`` each head holds K
    query rows then K gate rows (Qwen3-Next); without, all of it."""
    if not cfg.attn_output_gate:
        return q_BSF
    b, s, _ = q_BSF.shape
    return q_BSF.reshape(b, s, cfg.n_heads, 2, cfg.head_size)[:, :, :, 0].reshape(b, s, -1)


def gate_output(wq: dict, x_BSD: jax.Array, out_BSHK: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Softmax attention's output [B, S, H·K], times ``sigmoid`` of each head's gate rows of
    ``wq`` with ``cfg.attn_output_gate`` (Qwen3-Next's gated attention)."""
    b, s, h, k = out_BSHK.shape
    if not cfg.attn_output_gate:
        return out_BSHK.reshape(b, s, h * k)
    gate = linear(wq, x_BSD, cfg.lora_scale).reshape(b, s, h, 2, k)[:, :, :, 1]
    return (out_BSHK * jax.nn.sigmoid(gate)).reshape(b, s, h * k)


def gated_delta(p: dict, x_BSD: jax.Array, cfg: ModelConfig,
                docs: DocumentLayout | None = None) -> jax.Array:
    """The layer's output [B, S, D] (docs/model.md, "Gated DeltaNet")."""
    b, s, _ = x_BSD.shape
    g, h = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    k_dim, v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qkv, z, beta_in, a = _split(p, x_BSD, cfg, cfg.lora_scale)
    pos = None if docs is None else docs.positions_BS
    qkv = jax.nn.silu(causal_conv(qkv, p["conv1d"]["weight"][:, 0], pos))
    q, k, v = jnp.split(qkv, [g * k_dim, 2 * g * k_dim], axis=-1)
    q, k = (jnp.repeat(_l2norm(t.astype(jnp.float32).reshape(b, s, g, k_dim)), h // g, axis=2)
            for t in (q, k))
    decay = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p["dt_bias"])
    starts = jnp.zeros((b, s), bool) if pos is None else pos == 0
    o = recurrent_rule(q * k_dim ** -0.5, k, v.astype(jnp.float32).reshape(b, s, h, v_dim),
                       decay, jax.nn.sigmoid(beta_in).astype(jnp.float32), starts)
    o = gated_rmsnorm(o.astype(x_BSD.dtype), z, p["norm"]["weight"], cfg.norm_eps)
    return linear(p["out_proj"], o.reshape(b, s, h * v_dim), cfg.lora_scale)
