"""Mixtral-style MoE decoder: RMSNorm, half-split RoPE, causal attention, MoE FFN, loss.

Torch counterpart: ``torch_impl/model/decoder.py``, with ``attention.py``, ``moe_mlp.py`` and
``shared.py`` beside it (the MoE layer: ``reference/moe.py`` ↔ ``torch_impl/model/moe.py`` and
``router.py``; the dense MLP kind of the first ``first_k_dense`` layers: ``reference/dense.py``
↔ ``torch_impl/model/dense.py``; latent attention: ``reference/mla.py`` ↔ ``mla.py``).
Semantics: ``docs/model.md``.

Params are a plain nested dict mirroring the FQNs, with experts stacked on a leading global
expert axis (``layers[i]["moe"]["experts"]["w1"]["weight"]`` is [E, F, D]); see
``reference/weights.py`` for the exchange by FQN. Everything here is a pure function.

Precision: ``dtype`` is the compute dtype. Params are cast to it on entry (the compute copy of
fp32 masters); RMSNorm, the attention softmax, the router and the loss run in fp32.

Shape legend: B batch, S sequence, T tokens (B·S, row-major over (b, s)), D model dim,
H heads, G key/value heads, K head dim (D/H unless ``head_dim``), F expert hidden dim,
E experts, V vocab, L layers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moezero.plan.model_buffers import is_buffer
from moezero.reference.config import ModelConfig
from moezero.reference.dense import dense_mlp, init_dense
from moezero.reference.gated_delta import gate_output, gated_delta, init_gated_delta, query_rows
from moezero.reference.lora import linear
from moezero.reference.lora import with_lora as _with_lora
from moezero.reference.mla import init_mla, mla_attention
from moezero.reference.moe import acc_dtype, expert_load
from moezero.reference.moe_mlp import init_moe_mlp, moe_mlp
from moezero.reference.packing import DocumentLayout, document_layout
from moezero.reference.rope import apply_rope, rope_tables, rope_tables_at

__all__ = ["ModelConfig", "apply_rope", "attention", "forward", "init_params", "loss_fn",
           "rmsnorm", "rope_tables", "rope_tables_at"]


# ---------------------------------------------------------------------------------------- init


def _normal(key, shape, std):
    return std * jax.random.normal(key, shape, jnp.float32)


def _linear(key, out_dim: int, in_dim: int, std: float, bias: bool) -> dict:
    """``{weight: [out, in]}`` (torch Linear layout), with a zero ``bias`` [out] if asked."""
    p = {"weight": _normal(key, (out_dim, in_dim), std)}
    return {**p, "bias": jnp.zeros((out_dim,), jnp.float32)} if bias else p


def _init_attention(cfg: ModelConfig, key, std: float, out_std: float) -> dict:
    d, hk, gk, bias = cfg.dim, cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size, \
        cfg.attn_bias != "none"
    k = jax.random.split(key, 4)
    p = {"wq": _linear(k[0], hk * (1 + cfg.attn_output_gate), d, std, bias),  # gate rows too
         "wk": _linear(k[1], gk, d, std, bias), "wv": _linear(k[2], gk, d, std, bias),
         "wo": _linear(k[3], d, hk, out_std, cfg.attn_bias == "all")}
    if cfg.qk_norm != "none":
        per_head = cfg.qk_norm == "head"
        p["q_norm"] = {"weight": jnp.ones((cfg.head_size if per_head else hk,), jnp.float32)}
        p["k_norm"] = {"weight": jnp.ones((cfg.head_size if per_head else gk,), jnp.float32)}
    if cfg.attn_sinks:
        p["sinks"] = jnp.zeros((cfg.n_heads,), jnp.float32)
    return _with_lora(cfg, "attn", p)


def _init_layer(cfg: ModelConfig, key, index: int) -> dict:
    d = cfg.dim
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)
    k = jax.random.split(key, 6)
    mlp = {"mlp": init_dense(cfg, k[2], std, out_std)} if cfg.mlp_kind(index) == "dense" \
        else init_moe_mlp(cfg, k, std, out_std)
    mixer = init_gated_delta(cfg, k[0], std, out_std) if index in cfg.gated_delta_layers else \
        {"attn": (init_mla if cfg.attention == "mla" else _init_attention)(cfg, k[0], std, out_std)}
    return {"attn_norm": {"weight": jnp.ones((d,), jnp.float32)}, **mixer,
            "ffn_norm": {"weight": jnp.ones((d,), jnp.float32)}, **mlp}


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Fresh fp32 params (docs/model.md init): N(0, 0.02); wo, w2 N(0, 0.02/sqrt(2L)); gains 1."""
    k_embed, k_head, *k_layers = jax.random.split(key, cfg.n_layers + 2)
    return {
        "embed": {"weight": _normal(k_embed, (cfg.vocab_size, cfg.dim), 0.02)},
        "layers": [_init_layer(cfg, k, i) for i, k in enumerate(k_layers)],
        "norm": {"weight": jnp.ones((cfg.dim,), jnp.float32)},
        "lm_head": {"weight": _normal(k_head, (cfg.vocab_size, cfg.dim), 0.02)},
    }


# ------------------------------------------------------------------------------------- blocks


def rmsnorm(x: jax.Array, gain_D: jax.Array, eps: float) -> jax.Array:
    """``x · rsqrt(mean(x², -1) + eps) · g`` in fp32, cast back to x's dtype."""
    x32 = x.astype(acc_dtype(x.dtype))
    out = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (out * gain_D.astype(x32.dtype)).astype(x.dtype)


def _qk_heads(p: dict, x_BSD: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """q [B,S,H,K] and k [B,S,G,K], QK-normed where ``cfg.qk_norm`` says, before RoPE."""
    b, s, _ = x_BSD.shape
    q, k = linear(p["wq"], x_BSD, cfg.lora_scale), linear(p["wk"], x_BSD, cfg.lora_scale)
    q = query_rows(q, cfg)  # without the output gate's rows
    if cfg.qk_norm == "projection":  # OLMoE: over all heads at once
        q, k = (rmsnorm(q, p["q_norm"]["weight"], cfg.norm_eps),
                rmsnorm(k, p["k_norm"]["weight"], cfg.norm_eps))
    q_BSHK = q.reshape(b, s, cfg.n_heads, cfg.head_size)
    k_BSGK = k.reshape(b, s, cfg.kv_heads, cfg.head_size)
    if cfg.qk_norm == "head":  # Qwen3-MoE: each head's K dims
        q_BSHK = rmsnorm(q_BSHK, p["q_norm"]["weight"], cfg.norm_eps)
        k_BSGK = rmsnorm(k_BSGK, p["k_norm"]["weight"], cfg.norm_eps)
    return q_BSHK, k_BSGK


def attention(p: dict, x_BSD: jax.Array, cfg: ModelConfig,
              docs: DocumentLayout | None = None, window: int | None = None) -> jax.Array:
    """Causal grouped-query attention with RoPE; scores and softmax in fp32. Query head h
    reads key/value head ``h // (H/G)`` (transformers' ``repeat_kv``). With ``docs``: each
    query reads only its own document, rotary positions restarting per document. ``window``:
    query i reads keys j > i - window only. With ``p["sinks"]`` [H]: head h's sink logit
    joins every softmax as one more column, then is dropped (gpt-oss)."""
    b, s, _ = x_BSD.shape
    h, g, k = cfg.n_heads, cfg.kv_heads, cfg.head_size
    q_BSHK, k_BSGK = _qk_heads(p, x_BSD, cfg)
    v_BSGK = linear(p["wv"], x_BSD, cfg.lora_scale).reshape(b, s, g, k)
    r = cfg.rotary_dim
    cos, sin = rope_tables(s, r, cfg.rope_theta, cfg) if docs is None else \
        rope_tables_at(docs.positions_BS, r, cfg.rope_theta, cfg)
    q_BSHK, k_BSGK = apply_rope(q_BSHK, cos, sin), apply_rope(k_BSGK, cos, sin)
    k_BSHK, v_BSHK = jnp.repeat(k_BSGK, h // g, axis=2), jnp.repeat(v_BSGK, h // g, axis=2)
    scores_BHSS = jnp.einsum("bqhk,bshk->bhqs", q_BSHK, k_BSHK,
                             preferred_element_type=acc_dtype(x_BSD.dtype)) / math.sqrt(k)
    allowed = jnp.tril(jnp.ones((s, s), bool)) if docs is None else docs.allowed_BSS[:, None]
    if window is not None:
        i = jnp.arange(s)
        allowed = allowed & (i[:, None] - i[None, :] < window)
    scores_BHSS = jnp.where(allowed, scores_BHSS, -jnp.inf)
    if "sinks" in p:
        sink_BHS1 = jnp.broadcast_to(p["sinks"].astype(scores_BHSS.dtype)[None, :, None, None],
                                     (*scores_BHSS.shape[:3], 1))
        scores_BHSS = jnp.concatenate([scores_BHSS, sink_BHS1], axis=-1)
    probs_BHSS = jax.nn.softmax(scores_BHSS, axis=-1)[..., :s].astype(x_BSD.dtype)
    out_BSHK = jnp.einsum("bhqs,bshk->bqhk", probs_BHSS, v_BSHK)
    return linear(p["wo"], gate_output(p["wq"], x_BSD, out_BSHK, cfg), cfg.lora_scale)


class ForwardOut(NamedTuple):
    logits_BSV: jax.Array  # compute dtype
    aux_L: jax.Array  # per-MoE-layer load-balancing loss, fp32, unweighted (dense layers: none)
    z_L: jax.Array  # per-MoE-layer router z-loss, fp32, unweighted
    load_LE: jax.Array  # per-MoE-layer assignments per expert before drops, int32


def cast_params(params, dtype):
    """The compute copy: every leaf cast to ``dtype`` (fp32 masters stay untouched), except
    the buffers (the expert bias), which stay fp32 as on the torch side."""
    def cast(path, a):
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        return a if is_buffer(name) else a.astype(dtype)
    return jax.tree_util.tree_map_with_path(cast, params)


def forward_with_stats(params: dict, tokens_BS: jax.Array, cfg: ModelConfig, *,
                       dtype=jnp.float32, documents_BS: jax.Array | None = None) -> ForwardOut:
    """The decoder on one rank's batch; the MoE sees the B·S tokens of this call as T.
    ``documents_BS``: document labels of packed rows (``document_layout``)."""
    p = cast_params(params, dtype)
    docs = None if documents_BS is None else document_layout(documents_BS)
    h_BSD = p["embed"]["weight"][tokens_BS]
    b, s, d = h_BSD.shape
    aux, z, load = [], [], []
    for i, layer in enumerate(p["layers"]):
        x_BSD = rmsnorm(h_BSD, layer["attn_norm"]["weight"], cfg.norm_eps)
        if "linear_attn" in layer:
            mixed = gated_delta(layer["linear_attn"], x_BSD, cfg, docs)
        elif cfg.attention == "mla":
            mixed = mla_attention(layer["attn"], x_BSD, cfg, docs)
        else:
            mixed = attention(layer["attn"], x_BSD, cfg, docs, cfg.window(i))
        h_BSD = h_BSD + mixed
        x_TD = rmsnorm(h_BSD, layer["ffn_norm"]["weight"], cfg.norm_eps).reshape(b * s, d)
        if cfg.mlp_kind(i) == "dense":  # no router, no aux loss
            h_BSD = h_BSD + dense_mlp(layer["mlp"], x_TD, cfg.lora_scale).reshape(b, s, d)
            continue
        y_TD, out = moe_mlp(layer, x_TD, cfg)
        h_BSD = h_BSD + y_TD.reshape(b, s, d)
        aux.append(out.aux)
        z.append(out.z)
        load.append(expert_load(out.routing.topi_Tk, cfg.num_experts))
    logits_BSV = rmsnorm(h_BSD, p["norm"]["weight"], cfg.norm_eps) @ p["lm_head"]["weight"].T
    return ForwardOut(logits_BSV, jnp.stack(aux), jnp.stack(z), jnp.stack(load))


def weighted_aux(aux_L: jax.Array, z_L: jax.Array, cfg: ModelConfig) -> jax.Array:
    """``Σ_layers (aux_coef·aux + z_coef·z)``: the MoE term of the total loss."""
    return cfg.aux_loss_coef * jnp.sum(aux_L) + cfg.z_loss_coef * jnp.sum(z_L)


def forward(params: dict, tokens_BS: jax.Array, cfg: ModelConfig, *,
            dtype=jnp.float32, documents_BS: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Logits [B, S, V] and the weighted MoE loss term ``Σ (aux_coef·aux + z_coef·z)``."""
    out = forward_with_stats(params, tokens_BS, cfg, dtype=dtype, documents_BS=documents_BS)
    return out.logits_BSV, weighted_aux(out.aux_L, out.z_L, cfg)


# --------------------------------------------------------------------------------------- loss


def cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array,
                  loss_mask_BS: jax.Array | None = None, divisor=None) -> jax.Array:
    """Token cross-entropy in fp32: the mean over all B·S targets, or with ``loss_mask_BS``
    (True = trained) the sum over trained targets over ``divisor`` (default: their number
    here, at least 1; the engine's is the global count, docs/data.md)."""
    logits = logits_BSV.astype(acc_dtype(logits_BSV.dtype))
    picked_BS = jnp.take_along_axis(logits, targets_BS[..., None], axis=-1)[..., 0]
    nll_BS = jax.nn.logsumexp(logits, axis=-1) - picked_BS
    if loss_mask_BS is None:
        return jnp.mean(nll_BS)
    if divisor is None:
        divisor = jnp.maximum(jnp.sum(loss_mask_BS), 1)
    return jnp.sum(jnp.where(loss_mask_BS, nll_BS, 0.0)) / divisor


def loss_fn(params: dict, batch_BS1: jax.Array, cfg: ModelConfig, *,
            dtype=jnp.float32, loss_mask_BS: jax.Array | None = None,
            documents_BS: jax.Array | None = None, divisor=None) -> tuple[jax.Array, dict]:
    """One rank's loss on a [B, S+1] token batch: ``ce + Σ_l (aux_coef·aux + z_coef·z)``.

    Metrics: ``loss``; ``ce``; ``aux_loss``, the weighted MoE term added to ce (as torch_impl
    reports it); ``lb_loss`` and ``z_loss``, the unweighted sums over layers of aux and z;
    with ``cfg.expert_bias``, ``expert_load`` [L, E] int32 (what the bias update reads).
    ``loss_mask_BS``, ``divisor``: ``cross_entropy``'s; ``documents_BS``: ``forward``'s.
    """
    out = forward_with_stats(params, batch_BS1[:, :-1], cfg, dtype=dtype,
                             documents_BS=documents_BS)
    ce = cross_entropy(out.logits_BSV, batch_BS1[:, 1:], loss_mask_BS, divisor)
    aux_total = weighted_aux(out.aux_L, out.z_L, cfg)
    metrics = {"loss": ce + aux_total, "ce": ce, "aux_loss": aux_total,
               "lb_loss": jnp.sum(out.aux_L), "z_loss": jnp.sum(out.z_L)}
    if cfg.expert_bias:
        metrics["expert_load"] = out.load_LE
    return ce + aux_total, metrics


def split_batch(global_batch: jax.Array, world_size: int) -> jax.Array:
    """[W·b, ...] → [W, b, ...]: rank r owns the contiguous rows ``[r·b, (r+1)·b)``."""
    n = global_batch.shape[0]
    if n % world_size:
        raise ValueError(f"global batch of {n} rows does not split over {world_size} ranks")
    return global_batch.reshape(world_size, n // world_size, *global_batch.shape[1:])


def oracle_loss(params: dict, global_batch: jax.Array, cfg: ModelConfig, world_size: int, *,
                dtype=jnp.float32) -> tuple[jax.Array, dict]:
    """What a W-rank data-parallel run optimises: the mean over ranks of each rank's loss_fn.

    Each rank's slice is routed on its own (capacity, aux and z are per rank, docs/model.md, "MoE layer").
    """
    slices_WBS1 = split_batch(global_batch, world_size)
    _, metrics_W = jax.vmap(lambda b: loss_fn(params, b, cfg, dtype=dtype))(slices_WBS1)
    return metrics_W["loss"].mean(axis=0), mean_metrics(metrics_W, axis=0)


def masked_oracle_loss(params: dict, global_batch: jax.Array, loss_mask: jax.Array,
                       documents: jax.Array | None, cfg: ModelConfig, world_size: int, *,
                       dtype=jnp.float32) -> tuple[jax.Array, dict]:
    """``oracle_loss`` with a loss mask [W·b, S] (and document labels, or None): each rank's
    cross-entropy is its trained targets' sum over ``count / W``, ``count`` being the trained
    targets of the whole global batch, so the mean over ranks is ``Σ CE / count`` over the
    global batch, whatever W; the aux losses stay per rank (docs/data.md)."""
    divisor = jnp.maximum(jnp.sum(loss_mask), 1) / world_size
    slices = [split_batch(a, world_size) for a in (global_batch, loss_mask)]
    docs_W = None if documents is None else split_batch(documents, world_size)

    def rank_loss(batch, mask, docs):
        return loss_fn(params, batch, cfg, dtype=dtype, loss_mask_BS=mask, documents_BS=docs,
                       divisor=divisor)
    _, metrics_W = jax.vmap(rank_loss, in_axes=(0, 0, None if docs_W is None else 0))(
        *slices, docs_W)
    return metrics_W["loss"].mean(axis=0), mean_metrics(metrics_W, axis=0)


def mean_metrics(metrics: dict, axis: int = 0) -> dict:
    """Float metrics averaged over ``axis``; integer counts (``expert_load``) summed."""
    def reduce(m):
        return m.sum(axis=axis) if jnp.issubdtype(m.dtype, jnp.integer) else m.mean(axis=axis)
    return jax.tree.map(reduce, metrics)
