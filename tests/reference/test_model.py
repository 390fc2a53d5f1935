"""Reference model, MoE, weights and optimizer against docs/model.md, by hand-made examples."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from moezero.reference.model import (
    ModelConfig,
    apply_rope,
    forward,
    forward_with_stats,
    init_params,
    loss_fn,
    oracle_loss,
    rope_tables,
)
from moezero.reference.moe import assign_slots, capacity, moe_layer
from moezero.reference.optim import (
    OptimConfig,
    TrainConfig,
    clip_by_global_norm,
    decay_mask,
    init_train_state,
    lr_at,
    make_optimizer,
    train_step,
)
from moezero.reference.weights import (
    from_fqn_dict,
    load_params,
    param_shapes,
    save_params,
    to_fqn_dict,
)

TINY = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_dim=24, num_experts=4,
                   top_k=2)

# Compiled once per (config, shape): eager JAX compiles every op separately, far slower here.
jit_loss = jax.jit(loss_fn, static_argnames=("cfg", "dtype"))
jit_stats = jax.jit(forward_with_stats, static_argnames=("cfg", "dtype"))
jit_oracle = jax.jit(oracle_loss, static_argnames=("cfg", "world_size", "dtype"))
jit_moe = jax.jit(moe_layer, static_argnames=("top_k", "capacity_factor"))


def params_for(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random params for cfg, built by FQN in numpy (init_params' compile is slow on CPU)."""
    rng = np.random.default_rng(seed)
    flat = {fqn: np.ones(shape, np.float32) if fqn.endswith("norm.weight")
            else (0.1 * rng.standard_normal(shape)).astype(np.float32)
            for fqn, shape in param_shapes(cfg).items()}
    return from_fqn_dict(flat, cfg)


def tokens(seed, shape, vocab=TINY.vocab_size):
    return np.random.default_rng(seed).integers(0, vocab, shape, dtype=np.int32)


def normal(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def np_expert(moe_params, e, x_D):
    """SwiGLU expert e in float64 numpy: w2(silu(w1 x) * w3 x)."""
    w = {n: np.asarray(moe_params["experts"][n]["weight"][e], np.float64) for n in ("w1", "w3", "w2")}
    h = w["w1"] @ x_D
    return w["w2"] @ ((h / (1 + np.exp(-h))) * (w["w3"] @ x_D))


def naive_moe(moe_params, x_TD, top_k):
    """Token-by-token dropless float64 MoE: y_t = Σ_j gate_tj · expert_{topi_tj}(x_t)."""
    x = np.asarray(x_TD, np.float64)
    logits = x @ np.asarray(moe_params["router"]["weight"], np.float64).T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        topi = np.argsort(-probs[t], kind="stable")[:top_k]  # ties: lower index first
        gates = probs[t, topi] / probs[t, topi].sum()
        for j, e in enumerate(topi):
            y[t] += gates[j] * np_expert(moe_params, e, x[t])
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
    return {"router": {"weight": LITERAL_LOGITS_TE.T.astype(np.float32)},
            "experts": {"w1": {"weight": normal(1, (3, ffn, dim))},
                        "w3": {"weight": normal(2, (3, ffn, dim))},
                        "w2": {"weight": normal(3, (3, dim, ffn))}}}


def test_capacity_drop_order_matches_hand_computed_example():
    assert capacity(4, 3, 2, 0.75) == 2
    plan = jax.jit(assign_slots, static_argnums=(1, 2))(np.asarray(EXPECTED_TOPI), 3, 2)
    np.testing.assert_array_equal(plan.slot_Tk, EXPECTED_SLOT)
    np.testing.assert_array_equal(plan.keep_Tk, EXPECTED_KEEP)


def test_capacity_layer_output_hand_computed(tol):
    params, x = literal_moe_params(), np.eye(4, dtype=np.float32)
    out = jit_moe(params, x, top_k=2, capacity_factor=0.75)
    np.testing.assert_array_equal(out.routing.topi_Tk, EXPECTED_TOPI)
    np.testing.assert_allclose(out.routing.gates_Tk, [[GATE_HI, GATE_LO]] * 4, rtol=1e-6)
    ex = [functools.partial(np_expert, params, e) for e in range(3)]
    expected = np.stack([GATE_HI * ex[0](x[0]) + GATE_LO * ex[1](x[0]),
                         GATE_HI * ex[0](x[1]) + GATE_LO * ex[2](x[1]),
                         np.zeros(4),                 # both choices dropped
                         GATE_HI * ex[1](x[3])])      # second choice dropped, not renormalised
    np.testing.assert_allclose(out.y_TD, expected, rtol=1e-5, atol=1e-6)
    # aux counts are taken before drops: f = (4, 3, 1) / 8
    probs = np.exp(LITERAL_LOGITS_TE) / np.exp(LITERAL_LOGITS_TE).sum(-1, keepdims=True)
    aux = 3 * np.sum(np.array([4, 3, 1]) / 8 * probs.mean(0))
    np.testing.assert_allclose(out.aux, aux, rtol=1e-6)
    z = np.mean(np.log(np.exp(LITERAL_LOGITS_TE).sum(-1)) ** 2)
    np.testing.assert_allclose(out.z, z, rtol=1e-6)


def test_dropless_drops_nothing_even_when_all_tokens_pick_one_expert(tol):
    params = literal_moe_params(dim=6)
    params["router"]["weight"] = np.zeros((3, 6), np.float32)
    params["router"]["weight"][0] = 5.0  # every token (x > 0) prefers e0
    x_TD = np.random.default_rng(0).uniform(0.5, 1.0, (10, 6)).astype(np.float32)
    out = jit_moe(params, x_TD, top_k=2, capacity_factor=None)
    assert bool(jnp.all(out.plan.keep_Tk)) and bool(jnp.all(out.routing.topi_Tk[:, 0] == 0))
    np.testing.assert_allclose(out.y_TD, naive_moe(params, x_TD, 2), **tol("float32"))
    # Second choices tie between e1 and e2 (logit 0): the lower index, e1, wins. With C = 7,
    # e0 and e1 each drop their last 3 assignments: tokens 7, 8, 9 lose both choices.
    capped = jit_moe(params, x_TD, top_k=2, capacity_factor=1.0)
    assert bool(jnp.all(capped.routing.topi_Tk[:, 1] == 1))
    np.testing.assert_array_equal(capped.plan.keep_Tk, np.arange(10)[:, None].repeat(2, 1) < 7)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_top_k_matches_naive_loop(top_k, tol):
    cfg = dataclasses.replace(TINY, top_k=top_k)
    params = params_for(cfg)["layers"][0]["moe"]
    x_TD = normal(1, (12, cfg.dim))
    out = jit_moe(params, x_TD, top_k=top_k, capacity_factor=None)
    assert out.routing.topi_Tk.shape == (12, top_k)
    np.testing.assert_allclose(out.routing.gates_Tk.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(out.y_TD, naive_moe(params, x_TD, top_k), **tol("float32"))
    if top_k != 2:  # the whole model too (k=2 is every other test's default)
        loss, _ = jit_loss(params_for(cfg), tokens(3, (2, 9)), cfg=cfg)
        assert np.isfinite(float(loss))


def test_top1_gate_is_one():
    params = params_for(dataclasses.replace(TINY, top_k=1))
    out = jit_moe(params["layers"][0]["moe"], normal(1, (8, 16)),
                    top_k=1, capacity_factor=None)
    np.testing.assert_array_equal(out.routing.gates_Tk, 1.0)


@pytest.mark.parametrize("which", ["aux", "z"])
def test_router_loss_gradients_nonzero_and_match_finite_differences(which, tol):
    with jax.enable_x64(True):
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64),
                              params_for(TINY)["layers"][0]["moe"])
        x_TD = jnp.asarray(normal(1, (16, TINY.dim)), jnp.float64)

        @jax.jit
        def f(router_ED):
            p = {**params, "router": {"weight": router_ED}}
            return getattr(moe_layer(p, x_TD, top_k=2, capacity_factor=1.0), which)

        w = params["router"]["weight"] * 50  # sharper routing: aux moves visibly
        g = jax.jit(jax.grad(f))(w)
        assert float(jnp.max(jnp.abs(g))) > 1e-4
        for seed in range(3):
            v = jnp.asarray(normal(10 + seed, w.shape), jnp.float64)
            eps = 1e-5
            fd = (f(w + eps * v) - f(w - eps * v)) / (2 * eps)
            np.testing.assert_allclose(jnp.vdot(g, v), fd, **tol("finite_difference"))


# ------------------------------------------------------------------------------------ decoder


def test_rope_matches_hand_computed_example():
    # K=4, theta=1e4: inv_freq = (1, 0.01). Position 1 rotates x=(1,2,3,4) by angles (1, 0.01):
    # (1cos1 − 3sin1, 2cos.01 − 4sin.01, 3cos1 + 1sin1, 4cos.01 + 2sin.01).
    x_BSHK = np.array([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]], np.float32).reshape(1, 2, 1, 4)
    out = jax.jit(lambda x: apply_rope(x, *rope_tables(2, 4, 10000.0)))(x_BSHK)
    np.testing.assert_allclose(out[0, 0, 0], [1.0, 2.0, 3.0, 4.0], rtol=1e-7)  # position 0
    np.testing.assert_allclose(out[0, 1, 0], [-1.9841107, 1.9599007, 2.4623779, 4.0197997],
                               rtol=1e-6)


def test_causal_masking_future_tokens_do_not_change_earlier_logits():
    params = params_for(TINY)
    toks = tokens(1, (2, 8))
    changed = toks.copy()
    changed[:, 5] = (toks[:, 5] + 1) % TINY.vocab_size
    a = np.asarray(jit_stats(params, toks, cfg=TINY).logits_BSV)
    b = np.asarray(jit_stats(params, changed, cfg=TINY).logits_BSV)
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    assert np.abs(a[:, 5:] - b[:, 5:]).max(-1).min() > 0  # every later position sees the change


def test_loss_is_ce_plus_weighted_router_losses(tol):
    params = params_for(TINY)
    batch = tokens(1, (2, 9))
    loss, m = jit_loss(params, batch, cfg=TINY)
    out = jit_stats(params, batch[:, :-1], cfg=TINY)
    logits = np.asarray(out.logits_BSV, np.float64)
    lse = np.log(np.exp(logits).sum(-1))
    ce = np.mean(lse - np.take_along_axis(logits, np.asarray(batch[:, 1:])[..., None], -1)[..., 0])
    np.testing.assert_allclose(m["ce"], ce, **tol("float32"))
    expected = ce + 0.01 * out.aux_L.sum() + 0.001 * out.z_L.sum()
    np.testing.assert_allclose(loss, expected, **tol("float32"))
    np.testing.assert_allclose(m["aux_loss"], expected - ce, **tol("float32"))
    np.testing.assert_allclose(m["lb_loss"], out.aux_L.sum(), **tol("float32"))
    assert out.aux_L.shape == (2,) and float(out.aux_L.min()) > 0 and float(out.z_L.min()) > 0


def test_oracle_loss_routes_each_rank_slice_separately(tol):
    cfg = TINY  # dropless: still per-rank, since aux = E·Σ f·P takes means over local tokens
    params, batch = params_for(cfg), tokens(1, (4, 9))
    whole, _ = jit_loss(params, batch, cfg=cfg)
    halves = [jit_loss(params, batch[i:i + 2], cfg=cfg)[0] for i in (0, 2)]
    two, _ = jit_oracle(params, batch, cfg=cfg, world_size=2)
    np.testing.assert_allclose(two, (halves[0] + halves[1]) / 2, **tol("float32"))
    assert abs(float(two - whole)) > 1e-7  # aux is per rank: slicing matters


def test_bf16_compute_tracks_fp32(tol):
    params, batch = params_for(TINY), tokens(1, (2, 9))
    logits, _ = jax.eval_shape(functools.partial(forward, cfg=TINY, dtype=jnp.bfloat16),
                               params, batch[:, :-1])
    assert logits.dtype == jnp.bfloat16
    l32, _ = jit_loss(params, batch, cfg=TINY)
    l16, _ = jit_loss(params, batch, cfg=TINY, dtype=jnp.bfloat16)
    np.testing.assert_allclose(l16, l32, **tol("bfloat16"))
    grads = jax.eval_shape(jax.grad(lambda p: loss_fn(p, batch, TINY, dtype=jnp.bfloat16)[0]),
                           params)  # grads of the fp32 masters are fp32
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


# ------------------------------------------------------------------------------------ weights


def test_init_params_follows_documented_init():
    cfg = dataclasses.replace(TINY, dim=32, ffn_dim=64, n_layers=2)
    flat = to_fqn_dict(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0)))
    assert {k: v.shape for k, v in flat.items()} == param_shapes(cfg)
    np.testing.assert_array_equal(flat["layers.1.ffn_norm.weight"], 1.0)
    for fqn, std in [("embed.weight", 0.02), ("layers.0.attn.wq.weight", 0.02),
                     ("layers.1.attn.wo.weight", 0.01), ("layers.0.moe.experts.3.w2.weight", 0.01),
                     ("layers.1.moe.router.weight", 0.02)]:  # 0.02/sqrt(2·2) = 0.01
        np.testing.assert_allclose(flat[fqn].std(), std, rtol=0.15, err_msg=fqn)
    assert not np.allclose(flat["layers.0.moe.experts.0.w1.weight"],
                           flat["layers.0.moe.experts.1.w1.weight"])


def test_safetensors_round_trip_by_fqn(tmp_path):
    cfg = dataclasses.replace(TINY, n_layers=1, num_experts=2)
    params = params_for(cfg)
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
    cfg = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=2, total_steps=6)
    got = jax.jit(lr_at, static_argnums=0)(cfg, np.array([0, 1, 2, 4, 6, 10]))
    np.testing.assert_allclose(got, [0.5, 1.0, 1.0, 0.55, 0.1, 0.1], rtol=1e-6)


def test_clip_coefficient_and_decay_mask():
    grads = {"a": jnp.full((4,), 3.0), "b": jnp.full((1,), 4.0)}  # norm sqrt(36 + 16)
    clipped, norm, coef = jax.jit(clip_by_global_norm, static_argnums=1)(grads, 1.0)
    np.testing.assert_allclose(norm, math.sqrt(52.0), rtol=1e-6)
    np.testing.assert_allclose(coef, 1.0 / math.sqrt(52.0), rtol=1e-6)
    np.testing.assert_allclose(clipped["b"], 4.0 / math.sqrt(52.0), rtol=1e-6)
    assert float(jax.jit(clip_by_global_norm, static_argnums=1)(grads, 100.0)[2]) == 1.0
    mask = decay_mask(params_for(TINY))
    assert not mask["norm"]["weight"] and not mask["layers"][1]["ffn_norm"]["weight"]
    assert not mask["layers"][0]["attn_norm"]["weight"]
    assert mask["embed"]["weight"] and mask["layers"][0]["moe"]["experts"]["w1"]["weight"]


def test_weight_decay_skips_norm_gains():
    params = params_for(TINY)
    tx = make_optimizer(OptimConfig(lr=0.5, weight_decay=0.1))
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    new = jax.tree.map(lambda p, u: p + u, params, updates)
    np.testing.assert_array_equal(new["norm"]["weight"], params["norm"]["weight"])
    np.testing.assert_allclose(new["lm_head"]["weight"], params["lm_head"]["weight"] * 0.95,
                               rtol=1e-6)


def test_adamw_step_decreases_loss_on_repeated_batch(tol):
    cfg = TrainConfig(model=TINY, optim=OptimConfig(lr=1e-2, warmup_steps=2, total_steps=20),
                      world_size=2)
    params = params_for(TINY)
    state = jax.jit(init_train_state, static_argnums=0)(cfg, params)
    micro_MBS1 = tokens(1, (2, 4, 9))  # two micro-batches of a 2-rank global batch
    step = jax.jit(train_step, static_argnums=0)
    losses = []
    for i in range(12):
        state, m = step(cfg, state, micro_MBS1)
        losses.append(float(m["loss"]))
        if i == 0:  # the reported loss is the mean over micro-batches of the oracle loss
            want = [jit_oracle(params, mb, cfg=TINY, world_size=2)[0] for mb in micro_MBS1]
            np.testing.assert_allclose(m["loss"], np.mean(want), **tol("float32"))
            np.testing.assert_allclose(m["lr"], 5e-3, rtol=1e-6)  # warmup: lr·1/2
    assert int(state.step) == 12
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(np.isfinite(losses)) and float(m["grad_norm"]) > 0
