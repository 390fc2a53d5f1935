"""Op parity: each building block of docs/model.md, torch vs reference, on the same inputs.

RMSNorm, RoPE, attention, the dense MLP kind, the router (top-k, ties, gates), the capacity keep mask, the aux and
z losses with their gradients, and the whole MoE layer (dispatch / experts / combine) forward
and backward, dropless and with capacity, k = 1 and 2.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from moezero.model import decoder as torch_decoder
from moezero.model import moe as torch_moe
from moezero.model.packing import document_mask
from moezero.model.router import Router, RouterOptions
from moezero.reference import dense as ref_dense
from moezero.reference import gated_delta as ref_gated_delta
from moezero.reference import model as ref_model
from moezero.reference import moe as ref_moe
from moezero.reference.packing import document_layout
from parity_tests.models import OPTIONS, TINY, perturb, to_jax, torch_model
from parity_tests.tolerances import TOLERANCES
from tests.support.compare import (
    assert_close_by_fqn,
    assert_max_rel,
    assert_rel,
    assert_unequal_fraction,
    jax_fqns,
    torch_fqns,
)

jit_attention = jax.jit(ref_model.attention, static_argnames="cfg")
DTYPES = {"fp32": (torch.float32, jnp.float32), "bf16": (torch.bfloat16, jnp.bfloat16)}
T, D, E = 32, TINY.dim, TINY.num_experts


def rand(seed: int, *shape, scale: float = 1.0) -> np.ndarray:
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def both(x: np.ndarray, dtype: str) -> tuple[torch.Tensor, jax.Array]:
    """The same values on both sides in ``dtype`` (rounded once, in torch, then shared)."""
    t = torch.from_numpy(x).to(DTYPES[dtype][0])
    return t, jnp.asarray(t.float().numpy(), DTYPES[dtype][1])


# ------------------------------------------------------------------------ norm, rope, attention


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rmsnorm(dtype):
    x_t, x_j = both(rand(0, 2, 16, D, scale=3.0), dtype)
    gain = rand(1, D, scale=0.1) + 1.0
    norm = torch_decoder.RMSNorm(D, TINY.norm_eps).to(DTYPES[dtype][0])
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(gain))
    g_t, g_j = both(gain, dtype)
    assert torch.equal(norm.weight, g_t)
    expected = ref_model.rmsnorm(x_j, g_j, TINY.norm_eps)
    out = norm(x_t)
    assert_max_rel(out, expected, TOLERANCES[dtype].op_rel, f"{dtype} rmsnorm")
    assert_unequal_fraction(out, expected, TOLERANCES[dtype].op_unequal,
                            f"{dtype} rmsnorm unequal elements")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope(dtype, theta):
    seq, heads, head_dim = 64, 2, 16
    x_t, x_j = both(rand(2, 2, seq, heads, head_dim), dtype)
    cos, sin = ref_model.rope_tables(seq, head_dim, theta)
    expected = ref_model.apply_rope(x_j, cos, sin)
    out = torch_decoder.rope(x_t, theta)
    assert_max_rel(out, expected, TOLERANCES[dtype].op_rel, f"{dtype} rope")
    assert_unequal_fraction(out, expected, TOLERANCES[dtype].op_unequal,
                            f"{dtype} rope unequal elements")


def test_rope_is_half_split_rotation():
    """Position 1, pair 0 (inv_freq 1): (x1, x2) → (x1 cos 1 − x2 sin 1, x2 cos 1 + x1 sin 1)."""
    x = np.zeros((1, 2, 1, 4), np.float32)
    x[0, 1, 0] = [1.0, 0.0, 0.0, 0.0]  # x1 of pair 0 at position 1; its partner is index 2
    want = np.zeros_like(x)
    want[0, 1, 0] = [np.cos(1.0), 0.0, np.sin(1.0), 0.0]
    cos, sin = ref_model.rope_tables(2, 4, 10000.0)
    assert_max_rel(torch_decoder.rope(torch.from_numpy(x), 10000.0), want, TOLERANCES["fp32"].op_rel,
                   "torch rope (hand example)")
    assert_max_rel(ref_model.apply_rope(jnp.asarray(x), cos, sin), want,
                   TOLERANCES["fp32"].op_rel, "reference rope (hand example)")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dense_mlp(dtype):
    """The dense MLP kind (``model/dense.py`` vs ``reference/dense.py``), forward and the
    gradients of its input and weights."""
    cfg = OPTIONS["first-k-dense"]
    model = torch_model(cfg, seed=4)
    params = jax.tree.map(lambda a: a.astype(DTYPES[dtype][1]),
                          to_jax(model, cfg)["layers"][0]["mlp"])
    mlp = model.layers[0].mlp.to(DTYPES[dtype][0])
    x_t, x_j = both(rand(5, T, D), dtype)
    x_t.requires_grad_(True)
    out = mlp(x_t)
    assert_max_rel(out, ref_dense.dense_mlp(params, x_j), TOLERANCES[dtype].op_rel,
                   f"{dtype} dense mlp")
    out.float().square().sum().backward()

    def loss(p, x):
        return jnp.sum(jnp.square(ref_dense.dense_mlp(p, x).astype(jnp.float32)))
    g_p, g_x = jax.grad(loss, argnums=(0, 1))(params, x_j)
    assert_max_rel(x_t.grad, g_x, TOLERANCES[dtype].op_rel, f"{dtype} dense mlp input grad")
    assert_close_by_fqn(torch_fqns(mlp, grads=True), jax_fqns(g_p), TOLERANCES[dtype].grad_rel,
                        f"{dtype} dense mlp weight grads")


ATTENTION = {"mha": TINY, **{k: OPTIONS[k] for k in OPTIONS if "qk-norm" in k or "bias-" in k}}


@pytest.mark.parametrize("name", ATTENTION)
def test_attention(name):
    """Multi-head, grouped-query (G = 2, 1) with another head dim, QK-norm per head and per
    projection, q/k/v and output biases (gains and biases perturbed off their init)."""
    cfg = ATTENTION[name]
    model = perturb(torch_model(cfg, seed=3), seed=3)
    attn = model.layers[0].attn
    params = to_jax(model, cfg)["layers"][0]["attn"]
    x_t, x_j = both(rand(4, 2, 16, D), "fp32")
    expected = jit_attention(params, x_j, cfg)
    assert_max_rel(attn(x_t), expected, TOLERANCES["fp32"].op_rel, f"attention ({name})")


def test_attention_is_causal_on_both_sides():
    """Changing the last token changes no earlier output, on either side."""
    model = torch_model(TINY, seed=3)
    attn, params = model.layers[0].attn, to_jax(model, TINY)["layers"][0]["attn"]
    x = rand(4, 1, 16, D)
    y = x.copy()
    y[:, -1] += 1.0
    for f in (lambda a: attn(torch.from_numpy(a)).detach().numpy(),
              lambda a: np.asarray(jit_attention(params, jnp.asarray(a), TINY))):
        fx, fy = f(x), f(y)
        assert np.array_equal(fx[:, :-1], fy[:, :-1]) and not np.allclose(fx[:, -1], fy[:, -1])


# ------------------------------------------------------------------------------------- router


def torch_logits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """The torch MoE's router logits, as ``MoE.forward`` computes them (fp32 upcast)."""
    return torch.nn.functional.linear(x_TD.float(), w_ED.float())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_router_topk_and_gates(dtype, top_k):
    x_t, x_j = both(rand(5, T, D), dtype)
    w_t, w_j = both(rand(6, E, D, scale=0.3), dtype)
    logits_t = torch_logits(x_t, w_t)
    probs_t, gates_t, experts_t = torch_moe.route(logits_t, top_k)
    r = ref_moe.route(x_j, w_j, top_k)
    tol = TOLERANCES["fp32"].op_rel  # the router runs in fp32 on both sides, whatever x's dtype
    assert_max_rel(logits_t, r.logits_TE, tol, f"router logits ({dtype} x)")
    assert_max_rel(probs_t, r.probs_TE, tol, f"router probs ({dtype} x)")
    np.testing.assert_array_equal(experts_t.numpy(), np.asarray(r.topi_Tk))
    assert_max_rel(gates_t, r.gates_Tk, tol, f"gates ({dtype} x)")
    if top_k == 1:
        assert torch.all(gates_t == 1.0) and bool(jnp.all(r.gates_Tk == 1.0))


ROUTERS = {"sigmoid": dict(scoring="sigmoid"), "softmax-no-renorm": dict(renormalize=False),
           "sigmoid-no-renorm-bias": dict(scoring="sigmoid", renormalize=False, bias=True),
           "softmax-bias": dict(bias=True)}


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("name", ROUTERS)
def test_router_variants(name, top_k):
    """Sigmoid scores, no renormalisation, an expert bias steering the choice only: the
    same choices, gates and aux-loss probabilities on both sides."""
    opts = dict(ROUTERS[name])
    bias = rand(10, E, scale=0.05) if opts.pop("bias", False) else None
    x_t, x_j = both(rand(5, T, D), "fp32")
    w_t, w_j = both(rand(6, E, D, scale=0.3), "fp32")
    probs_t, gates_t, experts_t = torch_moe.route(
        torch_logits(x_t, w_t), top_k, bias_E=None if bias is None else torch.from_numpy(bias),
        **opts)
    r = ref_moe.route(x_j, w_j, top_k, bias_E=None if bias is None else jnp.asarray(bias),
                      **opts)
    tol = TOLERANCES["fp32"].op_rel
    np.testing.assert_array_equal(experts_t.numpy(), np.asarray(r.topi_Tk))
    assert_max_rel(gates_t, r.gates_Tk, tol, f"gates ({name})")
    assert_max_rel(probs_t, r.probs_TE, tol, f"router probs ({name})")
    if bias is not None:  # the bias changed some choice, so the test sees it
        _, _, unbiased = torch_moe.route(torch_logits(x_t, w_t), top_k, **opts)
        assert not torch.equal(unbiased, experts_t)


@pytest.mark.parametrize("rate", [1e-3, 0.5])
def test_expert_bias_update(rate):
    """Both sides' bias step on the same loads: +rate below the mean load, -rate above, 0 at
    it (exact: the sign is taken in integers), bit-equal."""
    load = np.array([3, 5, 4, 4], np.int64)  # mean 4
    bias = rand(11, E, scale=0.05)
    router = Router(D, E, 2, RouterOptions(expert_bias=True, bias_update_rate=rate))
    router.expert_bias.copy_(torch.from_numpy(bias))
    router.apply_load(torch.from_numpy(load))
    ref = ref_moe.update_expert_bias(jnp.asarray(bias), jnp.asarray(load, jnp.int32), rate)
    np.testing.assert_array_equal(router.expert_bias.numpy(), np.asarray(ref))
    want = bias + np.float32(rate) * np.array([1, -1, 0, 0], np.float32)
    np.testing.assert_array_equal(np.asarray(ref), want)


def test_router_ties_pick_lower_expert_first():
    """Exact ties (equal logits) on both sides: lower expert index first, equal gates."""
    logits = np.array([[0.0, 0.0, 0.0, 0.0],  # all tied: 0, 1
                       [1.0, 2.0, 2.0, 0.0],  # 1 and 2 tied at the top: 1, 2
                       [3.0, 1.0, 3.0, 3.0],  # three tied: 0, 2
                       [0.5, 0.5, 2.0, 0.5]], np.float32)  # winner, then a tie: 2, 0
    want = np.array([[0, 1], [1, 2], [0, 2], [2, 0]])
    _, gates_t, experts_t = torch_moe.route(torch.from_numpy(logits), 2)
    # logits @ I.T = logits exactly: the reference's router sees the same tied logits.
    r = ref_moe.route(jnp.asarray(logits), jnp.eye(4, dtype=jnp.float32), 2)
    np.testing.assert_array_equal(experts_t.numpy(), want)
    np.testing.assert_array_equal(np.asarray(r.topi_Tk), want)
    assert_max_rel(gates_t, r.gates_Tk, TOLERANCES["fp32"].op_rel, "tied gates")


# ---------------------------------------------------------------------------------- capacity


def doc_keep_mask(topi_Tk: np.ndarray, num_experts: int, cap: int | None) -> np.ndarray:
    """docs/model.md's drop order, literally: first choices by token, then second, ..."""
    num_tokens, top_k = topi_Tk.shape
    used, keep = [0] * num_experts, np.zeros_like(topi_Tk, bool)
    for j in range(top_k):
        for t in range(num_tokens):
            e = topi_Tk[t, j]
            keep[t, j] = cap is None or used[e] < cap
            used[e] += 1
    return keep


@pytest.mark.parametrize("capacity_factor", [None, 0.25, 0.5, 1.0, 1.25, 8.0])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_capacity_keep_masks_equal(capacity_factor, top_k):
    # Skewed routing (expert 0 popular) so that most capacities drop something.
    scores = np.random.default_rng(top_k).standard_normal((T, E)) + np.array([1.5, 0.5, 0, 0])
    topi = np.argsort(-scores, axis=1, kind="stable")[:, :top_k]
    keep_t = torch_moe.keep_mask(torch.from_numpy(topi), E, capacity_factor).numpy()
    cap = ref_moe.capacity(T, E, top_k, capacity_factor)
    keep_j = np.asarray(ref_moe.assign_slots(jnp.asarray(topi, jnp.int32), E, cap).keep_Tk)
    np.testing.assert_array_equal(keep_t, keep_j)
    np.testing.assert_array_equal(keep_t, doc_keep_mask(topi, E, cap))
    if capacity_factor in (0.25, 0.5):
        assert not keep_t.all() and keep_t.any()  # the case really drops


# ------------------------------------------------------------------------------ aux and z loss


@functools.partial(jax.jit, static_argnames="top_k")
def ref_router_losses(logits_TE, top_k):
    """The reference's (aux, z) from router logits, and the gradient of each."""
    def losses(lg):
        probs = jax.nn.softmax(lg, axis=-1)
        _, topi = jax.lax.top_k(probs, top_k)
        return ref_moe.aux_loss(probs, topi), ref_moe.z_loss(lg)

    grads = [jax.grad(lambda lg, i=i: losses(lg)[i])(logits_TE) for i in range(2)]
    return losses(logits_TE), grads


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_and_z_losses_and_their_gradients(top_k):
    logits = rand(7, T, E, scale=2.0)
    logits_t = torch.from_numpy(logits).requires_grad_(True)
    probs_t, _, experts_t = torch_moe.route(logits_t, top_k)
    aux_t, z_t = torch_moe.aux_losses(logits_t, probs_t, experts_t, E)
    grads_t = [torch.autograd.grad(v, logits_t, retain_graph=True)[0] for v in (aux_t, z_t)]

    (aux_j, z_j), grads_j = ref_router_losses(jnp.asarray(logits), top_k)
    tol = TOLERANCES["fp32"]
    assert_rel(aux_t, aux_j, tol.loss_rel, "aux loss")
    assert_rel(z_t, z_j, tol.loss_rel, "z loss")
    # Equal gradients also mean f_e (the counts) carries no gradient on either side.
    assert_rel(grads_t[0], grads_j[0], tol.grad_rel, "d aux / d logits")
    assert_rel(grads_t[1], grads_j[1], tol.grad_rel, "d z / d logits")


# ------------------------------------------------------------------------------- MoE layer


def moe_pair(top_k: int, capacity_factor: float | None, seed: int = 0):
    """A torch MoE with decisive routing and the same weights as reference params.

    Aux and z weigh 1 and 0.1 here: at k = 1 the gate is constantly 1, so the router's
    gradient is the aux/z term plus the gate path's rounding noise (mathematically zero,
    ~1e-7 × the output gradient); the default 0.01/0.001 would drown the term in the noise.
    """
    cfg = dataclasses.replace(TINY, top_k=top_k, capacity_factor=capacity_factor,
                              aux_loss_coef=1.0, z_loss_coef=0.1)
    moe = torch_moe.MoE(D, lambda e: torch_moe.SwiGLU(D, cfg.ffn_dim), num_experts=E,
                        top_k=top_k, capacity_factor=capacity_factor,
                        aux_loss_coef=cfg.aux_loss_coef, z_loss_coef=cfg.z_loss_coef)
    with torch.no_grad():
        for i, (name, p) in enumerate(moe.named_parameters()):
            scale = 0.3 if name == "router.weight" else 0.1  # routing sharper than at init
            p.copy_(torch.from_numpy(rand(100 * seed + i, *p.shape, scale=scale)))
    flat = {k: v.astype(np.float32) for k, v in torch_fqns(moe).items()}
    params = {"router": {"weight": jnp.asarray(flat["router.weight"])},
              "experts": {w: {"weight": jnp.stack([jnp.asarray(flat[f"experts.{e}.{w}.weight"])
                                                   for e in range(E)])}
                          for w in ("w1", "w3", "w2")}}
    return moe, params, cfg


@functools.partial(jax.jit, static_argnames="cfg")
def ref_moe_and_grads(params, x_TD, probe_TD, cfg):
    """Reference MoE output, weighted aux, keep mask; grads of ``Σ y·probe + aux``."""
    def f(p, x):
        out = ref_moe.moe_layer(p, x, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor)
        aux = cfg.aux_loss_coef * out.aux + cfg.z_loss_coef * out.z
        return jnp.sum(out.y_TD * probe_TD) + aux, (out.y_TD, aux, out.plan.keep_Tk)

    (_, (y, aux, keep)), (g_params, g_x) = jax.value_and_grad(
        f, argnums=(0, 1), has_aux=True)(params, x_TD)
    return y, aux, keep, g_params, g_x


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_layer_forward_and_backward(top_k, capacity_factor):
    moe, params, cfg = moe_pair(top_k, capacity_factor)
    x = rand(8, T, D)
    x_t = torch.from_numpy(x).requires_grad_(True)
    y_t, aux_t = moe(x_t)
    probe = rand(9, T, D)  # a random cotangent: every output element matters
    ((y_t * torch.from_numpy(probe)).sum() + aux_t).backward()

    y_j, aux_j, keep_j, g_params, g_x = ref_moe_and_grads(params, jnp.asarray(x),
                                                          jnp.asarray(probe), cfg)
    dropped = int(moe.last_stats["dropped"])
    assert dropped == int((~keep_j).sum())
    if capacity_factor is not None:
        assert dropped > 0, "the capacity case must drop something"
    tol = TOLERANCES["fp32"]
    assert_max_rel(y_t, y_j, tol.op_rel, "moe output")
    assert_rel(aux_t, aux_j, tol.loss_rel, "moe weighted aux")
    assert_rel(x_t.grad, g_x, tol.grad_rel, "d moe / d x")
    assert_close_by_fqn(torch_fqns(moe, grads=True), jax_fqns(g_params), tol.grad_rel,
                        "moe param grads")


# ------------------------------------------------------------------- Qwen3-Next's hybrid layers

HYBRID = OPTIONS["qwen3-next-hybrid"]
jit_gated_delta = jax.jit(ref_gated_delta.gated_delta, static_argnames="cfg")


@jax.jit
def _gated_delta_grads(params, x, docs):
    def loss(p, x):
        return jnp.sum(jnp.square(ref_gated_delta.gated_delta(p, x, HYBRID, docs)))
    return jax.grad(loss, argnums=(0, 1))(params, x)


@pytest.mark.parametrize("packed", [False, True])
def test_gated_delta_chunked_equals_the_recurrence(packed):
    """torch's chunked gated delta rule (chunks of 5 over 16 tokens) against the reference's
    token-by-token recurrence, forward and gradients; packed: three documents in a row, the
    state and the conv window restarting at each (one starts inside a chunk)."""
    model = perturb(torch_model(HYBRID, seed=5), seed=5)
    layer = model.layers[0].linear_attn
    params = to_jax(model, HYBRID)["layers"][0]["linear_attn"]
    x_t, x_j = both(rand(6, 2, 16, D), "fp32")
    x_t.requires_grad_(True)
    labels = np.repeat([[0, 1, 2]], 2, axis=0).repeat([7, 1, 8], axis=1)
    docs_t = document_mask(torch.from_numpy(labels)) if packed else None
    docs_j = document_layout(jnp.asarray(labels)) if packed else None
    out = layer(x_t, docs_t)
    assert_max_rel(out, jit_gated_delta(params, x_j, HYBRID, docs_j), TOLERANCES["fp32"].op_rel,
                   "gated delta")
    out.square().sum().backward()

    g_p, g_x = _gated_delta_grads(params, x_j, docs_j)
    assert_max_rel(x_t.grad, g_x, TOLERANCES["fp32"].op_rel, "gated delta input grad")
    assert_close_by_fqn(torch_fqns(layer, grads=True), jax_fqns(g_p),
                        TOLERANCES["fp32"].grad_rel, "gated delta weight grads")


def test_gated_attention():
    """The attention's sigmoid output gate (wq holding query and gate rows per head), with
    QK-norm per head, partial rotary and GQA, forward and input gradient."""
    model = perturb(torch_model(HYBRID, seed=7), seed=7)
    attn = model.layers[1].attn
    params = to_jax(model, HYBRID)["layers"][1]["attn"]
    x_t, x_j = both(rand(8, 2, 16, D), "fp32")
    x_t.requires_grad_(True)
    out = attn(x_t)
    assert_max_rel(out, jit_attention(params, x_j, HYBRID), TOLERANCES["fp32"].op_rel,
                   "gated attention")
    out.square().sum().backward()
    g_x = jax.jit(jax.grad(lambda x: jnp.sum(jnp.square(ref_model.attention(params, x, HYBRID)))))(x_j)
    assert_max_rel(x_t.grad, g_x, TOLERANCES["fp32"].op_rel, "gated attention input grad")
