"""Reference model, MoE, weights and optimizer against docs/model.md, by hand-made examples."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from reference.model import (ModelConfig, apply_rope, forward, forward_with_stats, init_params,
                             loss_fn, oracle_loss, rope_tables)
from reference.moe import assign_slots, capacity, moe_layer, swiglu
from reference.optim import (OptimConfig, TrainConfig, clip_by_global_norm, decay_mask,
                             init_train_state, lr_at, make_optimizer, train_step)
from reference.weights import from_fqn_dict, load_params, param_shapes, save_params, to_fqn_dict

TINY = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_dim=24, num_experts=4,
                   top_k=2)


def tokens(key, shape, vocab=TINY.vocab_size):
    return jax.random.randint(jax.random.key(key), shape, 0, vocab)


def naive_moe(moe_params, x_TD, top_k, keep_Tk=None):
    """Token-by-token float64 MoE in numpy: y_t = Σ_j gate_tj · expert_{topi_tj}(x_t)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), moe_params)
    x = np.asarray(x_TD, np.float64)
    logits = x @ p["router"]["weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        topi = np.argsort(-probs[t], kind="stable")[:top_k]  # ties: lower index first
        gates = probs[t, topi] / probs[t, topi].sum()
        for j, e in enumerate(topi):
            if keep_Tk is None or keep_Tk[t, j]:
                w = {n: p["experts"][n]["weight"][e] for n in ("w1", "w3", "w2")}
                h = x[t] @ w["w1"].T
                y[t] += gates[j] * (((h / (1 + np.exp(-h))) * (x[t] @ w["w3"].T)) @ w["w2"].T)
    return y


# ----------------------------------------------------------------------------- capacity / routing

# Hand-made routing, T=4 tokens, E=3 experts, k=2, capacity_factor=0.75 → C = ceil(0.75·4·2/3) = 2.
# Router logits (x = identity rows, so logits = router.T):
LITERAL_LOGITS_TE = np.array([[2.0, 1.0, 0.0],   # t0 → experts (0, 1)
                              [2.0, 0.0, 1.0],   # t1 → (0, 2)
                              [2.0, 1.0, 0.0],   # t2 → (0, 1)
                              [1.0, 2.0, 0.0]])  # t3 → (1, 0)
# Drop order: first choices t0→e0, t1→e0, t2→e0 (3rd for e0: dropped), t3→e1; then second
# choices t0→e1 (2nd for e1: kept), t1→e2, t2→e1 (3rd: dropped), t3→e0 (4th: dropped).
# Token-major order would instead keep (t2, e1) and drop t3's first choice (e1), so this
# example tells the two orders apart.
EXPECTED_TOPI = [[0, 1], [0, 2], [0, 1], [1, 0]]
EXPECTED_SLOT = [[0, 1], [1, 0], [2, 2], [0, 3]]
EXPECTED_KEEP = [[True, True], [True, True], [False, False], [True, False]]
GATE_HI, GATE_LO = 0.7310586, 0.2689414  # e/(e+1), 1/(e+1): top-2 logits differ by 1


def literal_moe_params(dim=4, ffn=5):
    k1, k3, k2 = jax.random.split(jax.random.key(7), 3)
    return {"router": {"weight": jnp.asarray(LITERAL_LOGITS_TE.T, jnp.float32)},
            "experts": {"w1": {"weight": jax.random.normal(k1, (3, ffn, dim))},
                        "w3": {"weight": jax.random.normal(k3, (3, ffn, dim))},
                        "w2": {"weight": jax.random.normal(k2, (3, dim, ffn))}}}


def test_capacity_drop_order_matches_hand_computed_example():
    assert capacity(4, 3, 2, 0.75) == 2
    plan = assign_slots(jnp.asarray(EXPECTED_TOPI), 3, 2)
    np.testing.assert_array_equal(plan.slot_Tk, EXPECTED_SLOT)
    np.testing.assert_array_equal(plan.keep_Tk, EXPECTED_KEEP)


def test_capacity_layer_output_hand_computed(tol):
    params, x_TD = literal_moe_params(), jnp.eye(4)
    out = moe_layer(params, x_TD, top_k=2, capacity_factor=0.75)
    np.testing.assert_array_equal(out.routing.topi_Tk, EXPECTED_TOPI)
    np.testing.assert_allclose(out.routing.gates_Tk, [[GATE_HI, GATE_LO]] * 4, rtol=1e-6)
    ex = [lambda x, e=e: swiglu(*(params["experts"][n]["weight"][e] for n in ("w1", "w3", "w2")),
                                x[None])[0] for e in range(3)]
    x = x_TD
    expected = jnp.stack([GATE_HI * ex[0](x[0]) + GATE_LO * ex[1](x[0]),
                          GATE_HI * ex[0](x[1]) + GATE_LO * ex[2](x[1]),
                          jnp.zeros(4),                 # both choices dropped
                          GATE_HI * ex[1](x[3])])       # second choice dropped, not renormalised
    np.testing.assert_allclose(out.y_TD, expected, rtol=1e-5, atol=1e-6)
    # aux counts are taken before drops: f = (4, 3, 1) / 8
    probs = np.exp(LITERAL_LOGITS_TE) / np.exp(LITERAL_LOGITS_TE).sum(-1, keepdims=True)
    aux = 3 * np.sum(np.array([4, 3, 1]) / 8 * probs.mean(0))
    np.testing.assert_allclose(out.aux, aux, rtol=1e-6)
    z = np.mean(np.log(np.exp(LITERAL_LOGITS_TE).sum(-1)) ** 2)
    np.testing.assert_allclose(out.z, z, rtol=1e-6)


def test_dropless_drops_nothing_even_when_all_tokens_pick_one_expert(tol):
    params = literal_moe_params(dim=6)
    params["router"]["weight"] = jnp.zeros((3, 6)).at[0].set(5.0)  # every token prefers e0
    x_TD = jax.random.uniform(jax.random.key(1), (10, 6), minval=0.5, maxval=1.0)
    out = moe_layer(params, x_TD, top_k=2, capacity_factor=None)
    assert bool(jnp.all(out.plan.keep_Tk)) and bool(jnp.all(out.routing.topi_Tk[:, 0] == 0))
    np.testing.assert_allclose(out.y_TD, naive_moe(params, x_TD, 2), **tol("float32"))
    # Second choices tie between e1 and e2 (logit 0): the lower index, e1, wins. With C = 7,
    # e0 and e1 each drop their last 3 assignments: tokens 7, 8, 9 lose both choices.
    capped = moe_layer(params, x_TD, top_k=2, capacity_factor=1.0)
    assert bool(jnp.all(capped.routing.topi_Tk[:, 1] == 1))
    np.testing.assert_array_equal(capped.plan.keep_Tk, np.arange(10)[:, None].repeat(2, 1) < 7)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_top_k_matches_naive_loop(top_k, tol):
    cfg = dataclasses.replace(TINY, top_k=top_k)
    params = init_params(cfg, jax.random.key(0))["layers"][0]["moe"]
    x_TD = jax.random.normal(jax.random.key(1), (12, cfg.dim))
    out = moe_layer(params, x_TD, top_k=top_k, capacity_factor=None)
    assert out.routing.topi_Tk.shape == (12, top_k)
    np.testing.assert_allclose(out.routing.gates_Tk.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(out.y_TD, naive_moe(params, x_TD, top_k), **tol("float32"))
    loss, _ = loss_fn(init_params(cfg, jax.random.key(2)), tokens(3, (2, 9)), cfg)
    assert np.isfinite(float(loss))


def test_top1_gate_is_one():
    params = init_params(dataclasses.replace(TINY, top_k=1), jax.random.key(0))
    out = moe_layer(params["layers"][0]["moe"], jax.random.normal(jax.random.key(1), (8, 16)),
                    top_k=1, capacity_factor=None)
    np.testing.assert_array_equal(out.routing.gates_Tk, 1.0)


@pytest.mark.parametrize("which", ["aux", "z"])
def test_router_loss_gradients_nonzero_and_match_finite_differences(which, tol):
    with jax.enable_x64(True):
        params = jax.tree.map(lambda a: a.astype(jnp.float64),
                              init_params(TINY, jax.random.key(0))["layers"][0]["moe"])
        x_TD = jax.random.normal(jax.random.key(1), (16, TINY.dim), jnp.float64)

        def f(router_ED):
            p = {**params, "router": {"weight": router_ED}}
            return getattr(moe_layer(p, x_TD, top_k=2, capacity_factor=1.0), which)

        w = params["router"]["weight"] * 50  # sharper routing: aux moves visibly
        g = jax.grad(f)(w)
        assert float(jnp.max(jnp.abs(g))) > 1e-4
        for seed in range(3):
            v = jax.random.normal(jax.random.key(10 + seed), w.shape, jnp.float64)
            eps = 1e-5
            fd = (f(w + eps * v) - f(w - eps * v)) / (2 * eps)
            np.testing.assert_allclose(jnp.vdot(g, v), fd, **tol("finite_difference"))


# ------------------------------------------------------------------------------------ decoder


def test_rope_matches_hand_computed_example():
    # K=4, theta=1e4: inv_freq = (1, 0.01). Position 1 rotates x=(1,2,3,4) by angles (1, 0.01):
    # (1cos1 − 3sin1, 2cos.01 − 4sin.01, 3cos1 + 1sin1, 4cos.01 + 2sin.01).
    x_BSHK = jnp.asarray([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]]).reshape(1, 2, 1, 4)
    out = apply_rope(x_BSHK, *rope_tables(2, 4, 10000.0))
    np.testing.assert_allclose(out[0, 0, 0], [1.0, 2.0, 3.0, 4.0], rtol=1e-7)  # position 0
    np.testing.assert_allclose(out[0, 1, 0], [-1.9841107, 1.9599007, 2.4623779, 4.0197997],
                               rtol=1e-6)


def test_causal_masking_future_tokens_do_not_change_earlier_logits():
    params = init_params(TINY, jax.random.key(0))
    toks = tokens(1, (2, 8))
    changed = toks.at[:, 5].set((toks[:, 5] + 1) % TINY.vocab_size)
    a, _ = forward(params, toks, TINY)
    b, _ = forward(params, changed, TINY)
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    assert float(jnp.min(jnp.max(jnp.abs(a[:, 5:] - b[:, 5:]), axis=-1))) > 0


def test_loss_is_ce_plus_weighted_router_losses(tol):
    params = init_params(TINY, jax.random.key(0))
    batch = tokens(1, (2, 9))
    loss, m = loss_fn(params, batch, TINY)
    out = forward_with_stats(params, batch[:, :-1], TINY)
    logits = np.asarray(out.logits_BSV, np.float64)
    lse = np.log(np.exp(logits).sum(-1))
    ce = np.mean(lse - np.take_along_axis(logits, np.asarray(batch[:, 1:])[..., None], -1)[..., 0])
    np.testing.assert_allclose(m["ce"], ce, **tol("float32"))
    expected = ce + 0.01 * out.aux_L.sum() + 0.001 * out.z_L.sum()
    np.testing.assert_allclose(loss, expected, **tol("float32"))
    assert out.aux_L.shape == (2,) and float(out.aux_L.min()) > 0 and float(out.z_L.min()) > 0


def test_oracle_loss_routes_each_rank_slice_separately(tol):
    cfg = dataclasses.replace(TINY, capacity_factor=0.5)
    params, batch = init_params(cfg, jax.random.key(0)), tokens(1, (4, 9))
    whole, _ = loss_fn(params, batch, cfg)
    np.testing.assert_allclose(oracle_loss(params, batch, cfg, 1)[0], whole, **tol("float32"))
    halves = [loss_fn(params, batch[i:i + 2], cfg)[0] for i in (0, 2)]
    two, _ = oracle_loss(params, batch, cfg, 2)
    np.testing.assert_allclose(two, (halves[0] + halves[1]) / 2, **tol("float32"))
    assert abs(float(two - whole)) > 1e-6  # capacity is per rank: slicing matters


def test_bf16_compute_tracks_fp32(tol):
    params, batch = init_params(TINY, jax.random.key(0)), tokens(1, (2, 9))
    logits, _ = forward(params, batch[:, :-1], TINY, dtype=jnp.bfloat16)
    assert logits.dtype == jnp.bfloat16
    l32, _ = loss_fn(params, batch, TINY)
    l16, _ = loss_fn(params, batch, TINY, dtype=jnp.bfloat16)
    np.testing.assert_allclose(l16, l32, **tol("bfloat16"))
    grads = jax.grad(lambda p: loss_fn(p, batch, TINY, dtype=jnp.bfloat16)[0])(params)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


# ------------------------------------------------------------------------------------ weights


def test_safetensors_round_trip_by_fqn(tmp_path):
    cfg = dataclasses.replace(TINY, n_layers=1, num_experts=2)
    params = init_params(cfg, jax.random.key(0))
    save_params(str(tmp_path / "model.safetensors"), params)
    raw = load_file(str(tmp_path / "model.safetensors"))
    layer = ["attn_norm.weight", "attn.wq.weight", "attn.wk.weight", "attn.wv.weight",
             "attn.wo.weight", "ffn_norm.weight", "moe.router.weight"]
    layer += [f"moe.experts.{e}.{w}.weight" for e in range(2) for w in ("w1", "w2", "w3")]
    expected = {"embed.weight", "norm.weight", "lm_head.weight"} | {f"layers.0.{n}" for n in layer}
    assert set(raw) == expected == set(param_shapes(cfg))
    assert raw["layers.0.moe.experts.1.w1.weight"].shape == (cfg.ffn_dim, cfg.dim)
    assert raw["layers.0.moe.experts.1.w2.weight"].shape == (cfg.dim, cfg.ffn_dim)
    np.testing.assert_array_equal(raw["layers.0.moe.experts.1.w3.weight"],
                                  params["layers"][0]["moe"]["experts"]["w3"]["weight"][1])
    loaded = load_params(str(tmp_path / "model.safetensors"), cfg)
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    flat = to_fqn_dict(params)
    del flat["layers.0.moe.experts.0.w1.weight"]
    with pytest.raises(ValueError, match=r"experts\.0\.w1"):
        from_fqn_dict(flat, cfg)


# ---------------------------------------------------------------------------------- optimizer


def test_lr_schedule_warmup_then_cosine():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=2, total_steps=6)
    got = [float(lr_at(cfg, s)) for s in (0, 1, 2, 4, 6, 10)]
    np.testing.assert_allclose(got, [0.5, 1.0, 1.0, 0.55, 0.1, 0.1], rtol=1e-6)


def test_clip_coefficient_and_decay_mask():
    grads = {"a": jnp.full((4,), 3.0), "b": jnp.full((1,), 4.0)}  # norm sqrt(36 + 16)
    clipped, norm, coef = clip_by_global_norm(grads, 1.0)
    np.testing.assert_allclose(norm, math.sqrt(52.0), rtol=1e-6)
    np.testing.assert_allclose(coef, 1.0 / (math.sqrt(52.0) + 1e-6), rtol=1e-6)
    assert float(clip_by_global_norm(grads, 100.0)[2]) == 1.0
    mask = decay_mask(init_params(TINY, jax.random.key(0)))
    assert not mask["norm"]["weight"] and not mask["layers"][1]["ffn_norm"]["weight"]
    assert not mask["layers"][0]["attn_norm"]["weight"]
    assert mask["embed"]["weight"] and mask["layers"][0]["moe"]["experts"]["w1"]["weight"]


def test_weight_decay_skips_norm_gains():
    params = init_params(TINY, jax.random.key(0))
    cfg = OptimConfig(lr=0.5, weight_decay=0.1)
    tx = make_optimizer(cfg)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    new = jax.tree.map(lambda p, u: p + u, params, updates)
    np.testing.assert_array_equal(new["norm"]["weight"], params["norm"]["weight"])
    np.testing.assert_allclose(new["lm_head"]["weight"], params["lm_head"]["weight"] * 0.95,
                               rtol=1e-6)


def test_adamw_step_decreases_loss_on_repeated_batch():
    cfg = TrainConfig(model=TINY, optim=OptimConfig(lr=1e-2, warmup_steps=2, total_steps=20),
                      world_size=2)
    state = init_train_state(cfg, init_params(TINY, jax.random.key(0)))
    batch = tokens(1, (4, 9))
    step = jax.jit(train_step, static_argnums=0)
    losses = []
    for _ in range(12):
        state, m = step(cfg, state, batch)
        losses.append(float(m["loss"]))
    assert int(state.step) == 12
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(np.isfinite(losses)) and float(m["grad_norm"]) > 0
    _, m2 = step(cfg, state, jnp.stack([batch, batch]))  # two identical micro-batches
    _, m1 = step(cfg, state, batch)
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-6)
