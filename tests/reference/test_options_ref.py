"""The reference's decoder and router options (docs/model.md) by identities that need no
torch: grouped-query attention is multi-head attention with K/V heads repeated, QK-norm per
projection is per head when there is one head, a zero shared gate halves the shared expert,
and a train step moves the expert bias by ±rate on the step's loads, outside the optimizer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from moezero.plan.model_buffers import is_buffer
from moezero.reference.model import ModelConfig, attention, forward_with_stats
from moezero.reference.moe_mlp import shared_expert
from moezero.reference.optim import (
    OptimConfig,
    TrainConfig,
    decay_mask,
    init_train_state,
    train_step,
)
from moezero.reference.weights import from_fqn_dict, tensor_shapes, to_fqn_dict

TINY = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, ffn_dim=24, num_experts=4,
                   top_k=2)


def params_for(cfg: ModelConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    flat = {fqn: (1.0 + 0.1 * rng.standard_normal(shape) if fqn.endswith("norm.weight")
                  else 0.2 * rng.standard_normal(shape)).astype(np.float32)
            for fqn, shape in tensor_shapes(cfg).items()}
    return from_fqn_dict(flat, cfg)


def x_BSD(seed: int, dim: int = 16) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((2, 5, dim)), jnp.float32)


def test_gqa_is_mha_with_repeated_kv_heads():
    gqa = dataclasses.replace(TINY, n_kv_heads=2, attn_bias="all")
    p = params_for(gqa)["layers"][0]["attn"]
    k = gqa.head_size

    def repeat(a):  # [G·K, ...] -> [H·K, ...]: kv head g serves query heads 2g, 2g + 1
        return jnp.repeat(a.reshape(2, k, *a.shape[1:]), 2, axis=0).reshape(4 * k, *a.shape[1:])

    mha = {**p, **{w: {n: repeat(v) for n, v in p[w].items()} for w in ("wk", "wv")}}
    x = x_BSD(1)
    np.testing.assert_allclose(attention(p, x, gqa),
                               attention(mha, x, dataclasses.replace(gqa, n_kv_heads=None)),
                               rtol=1e-6, atol=1e-6)


def test_qk_norm_per_projection_is_per_head_with_one_head():
    cfg = dataclasses.replace(TINY, n_heads=1, qk_norm="head")
    p, x = params_for(cfg)["layers"][0]["attn"], x_BSD(2)
    np.testing.assert_array_equal(attention(p, x, cfg),
                                  attention(p, x, dataclasses.replace(cfg, qk_norm="projection")))
    assert not np.allclose(attention(p, x, cfg),
                           attention(p, x, dataclasses.replace(cfg, qk_norm="none")))


def test_a_zero_shared_gate_halves_the_shared_expert():
    cfg = dataclasses.replace(TINY, shared_ffn_dim=8, shared_gate=True)
    p = params_for(cfg)["layers"][0]["shared"]
    x = x_BSD(3)
    ungated = shared_expert({k: v for k, v in p.items() if k != "gate"}, x)
    zero = {**p, "gate": {"weight": jnp.zeros_like(p["gate"]["weight"])}}
    np.testing.assert_allclose(shared_expert(zero, x), 0.5 * ungated, rtol=1e-6)


def test_train_step_moves_the_expert_bias_on_the_loads_outside_the_optimizer():
    model = dataclasses.replace(TINY, router_scoring="sigmoid", expert_bias=True,
                                bias_update_rate=0.5)
    cfg = TrainConfig(model=model, optim=OptimConfig(lr=1e-2, weight_decay=0.1))
    params = params_for(model)
    batch = jnp.asarray(np.random.default_rng(4).integers(0, 32, (4, 9)), jnp.int32)
    load_LE = forward_with_stats(params, batch[:, :-1], model).load_LE
    assert int(load_LE.sum()) == model.n_layers * 4 * 8 * model.top_k
    mask = to_fqn_dict(jax.tree.map(lambda m, p: np.full(p.shape, m), decay_mask(params), params))
    assert not any(mask[k].any() for k in mask if is_buffer(k) or k.endswith(".bias"))
    state, _ = jax.jit(train_step, static_argnums=0)(cfg, init_train_state(cfg, params), batch)
    before, after = to_fqn_dict(params), to_fqn_dict(state.params)
    for i, load_E in enumerate(np.asarray(load_LE)):
        fqn = f"layers.{i}.moe.router.expert_bias"
        step = 0.5 * np.sign(load_E.sum() - 4 * load_E).astype(np.float32)
        np.testing.assert_array_equal(after[fqn], before[fqn] + step)
    assert not np.array_equal(after["layers.0.moe.router.weight"],
                              before["layers.0.moe.router.weight"])
