"""Expert-parallel MoE (shard_map + all_to_all on forced host devices) equals its unsharded twin."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moezero.reference.model import ModelConfig, init_params
from moezero.reference.moe import moe_layer
from moezero.reference.sharded import make_mesh, moe_layer_per_slice, moe_layer_sharded

CFG = ModelConfig(dim=8, n_heads=2, ffn_dim=8, num_experts=8, top_k=2, n_layers=1)
NUM_TOKENS = 32  # all ranks together; 8 per rank at W=4
# (W, ep, capacity_factor); ep < W adds an expert-data-parallel axis (expert grads summed over it)
CASES = [(2, 2, None), (2, 2, 0.5), (4, 4, None), (4, 4, 0.5), (4, 2, 0.5)]


@functools.cache
def inputs():
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(functools.partial(init_params, CFG), jax.random.key(0))
    normal = lambda shape, std: jnp.asarray(std * rng.standard_normal(shape), jnp.float32)
    params = jax.tree.map(lambda a: normal(a.shape, 0.2), shapes["layers"][0]["moe"])
    params["router"]["weight"] = normal((CFG.num_experts, CFG.dim), 1.0)  # uneven: drops happen
    return params, normal((NUM_TOKENS, CFG.dim), 1.0), normal((NUM_TOKENS, CFG.dim), 1.0)


def scalar_loss(layer_fn, params, x_TD, cot_TD):
    """A loss touching every output: y against a fixed cotangent, plus weighted aux and z."""
    out = layer_fn(params, x_TD)
    return jnp.sum(out.y_TD * cot_TD) + 0.3 * jnp.sum(out.aux_W) + 0.1 * jnp.sum(out.z_W), out


def value_and_grads(layer_fn):
    fn = jax.value_and_grad(functools.partial(scalar_loss, layer_fn), argnums=(0, 1),
                            has_aux=True)
    return jax.jit(fn)(*inputs())


@functools.cache
def twin_value_and_grads(world_size, capacity_factor):
    """The oracle depends on W only (not on ep): computed once per (W, mode)."""
    return value_and_grads(functools.partial(moe_layer_per_slice, world_size=world_size,
                                             top_k=CFG.top_k, capacity_factor=capacity_factor))


@pytest.mark.parametrize(("world_size", "ep", "capacity_factor"), CASES,
                         ids=lambda v: {None: "dropless", 0.5: "capacity"}.get(v, str(v)))
def test_sharded_moe_equals_unsharded_twin_forward_and_grad(world_size, ep, capacity_factor,
                                                             tol):
    mesh = make_mesh(world_size, ep)
    (_, got), got_grads = value_and_grads(functools.partial(
        moe_layer_sharded, mesh=mesh, top_k=CFG.top_k, capacity_factor=capacity_factor))
    (_, want), want_grads = twin_value_and_grads(world_size, capacity_factor)
    assert got.aux_W.shape == (world_size,)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, **tol("float32"))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol("float32")),
                 got_grads, want_grads)
    assert float(jnp.max(jnp.abs(got_grads[0]["router"]["weight"]))) > 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_capacity_case_really_drops_and_ranks_route_separately(world_size):
    params, x_TD, _ = inputs()
    @jax.jit
    def whole_and_kept(params, x_TD):
        layer = functools.partial(moe_layer, params, top_k=2, capacity_factor=0.5)
        keep_WTk = jax.vmap(lambda x: layer(x).plan.keep_Tk)(x_TD.reshape(world_size, -1, CFG.dim))
        return layer(x_TD).y_TD, keep_WTk

    whole_y, keep_WTk = whole_and_kept(params, x_TD)
    assert not bool(jnp.any(jnp.all(keep_WTk, axis=(1, 2))))  # every rank drops: not vacuous
    (_, sliced), _ = twin_value_and_grads(world_size, 0.5)
    assert not np.allclose(whole_y, sliced.y_TD)  # per-rank capacity is part of the semantics


def test_experts_are_split_and_dispatch_uses_all_to_all():
    params, x_TD, _ = inputs()
    mesh = make_mesh(4, 4)
    fn = functools.partial(moe_layer_sharded, mesh=mesh, top_k=2, capacity_factor=None)
    jaxpr = str(jax.make_jaxpr(fn)(params, x_TD))
    assert jaxpr.count("all_to_all") == 2  # rows out to expert owners, results back
    # each rank sees only its E/ep = 2 experts: local w1 blocks are [2, F, D]
    assert f"f32[2,{CFG.ffn_dim},{CFG.dim}]" in jaxpr
    out = jax.jit(fn)(params, x_TD)
    assert out.y_TD.sharding.spec[0] == ("edp", "ep")  # tokens stay split over all ranks


def test_sharded_moe_with_expert_lora_adapters_equals_its_twin(tol):
    """Routed-expert LoRA adapters are sharded with their experts (each on its EP rank) and
    scaled alike on both paths."""
    cfg = ModelConfig(dim=8, n_heads=2, ffn_dim=8, num_experts=8, top_k=2, n_layers=1,
                      lora_r=2, lora_scale=2.0, lora_targets=("experts",))
    rng = np.random.default_rng(1)
    shapes = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))
    params = jax.tree.map(lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), jnp.float32),
                          shapes["layers"][0]["moe"])
    assert params["experts"]["w2"]["lora_B"].shape == (8, 8, 2)
    x, cot = (jnp.asarray(rng.standard_normal((NUM_TOKENS, 8)), jnp.float32) for _ in range(2))
    loss = lambda fn, p: jnp.sum(fn(p, x).y_TD * cot)
    kw = {"top_k": 2, "capacity_factor": None, "lora_scale": 2.0}
    got = jax.jit(jax.value_and_grad(functools.partial(
        loss, functools.partial(moe_layer_sharded, mesh=make_mesh(2, 2), **kw))))(params)
    want = jax.jit(jax.value_and_grad(functools.partial(
        loss, functools.partial(moe_layer_per_slice, world_size=2, **kw))))(params)
    plain = loss(functools.partial(moe_layer_per_slice, world_size=2, top_k=2,
                                   capacity_factor=None), params)
    assert abs(float(want[0]) - float(plain)) > 1e-3  # the scale matters
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol("float32")), got, want)
