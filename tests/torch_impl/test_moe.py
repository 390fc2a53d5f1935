"""The MoE layer: routing, capacity drop order, dropless, aux and z-loss gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moezero.model.moe import MoE, SwiGLU, aux_losses, expert_tag, keep_mask, route


def make_moe(**kw) -> MoE:
    torch.manual_seed(0)
    return MoE(8, SwiGLU(8, 16), num_experts=kw.pop("num_experts", 4), **kw)


def test_capacity_drops_in_documented_order():
    # 4 tokens, 2 experts, k=2, capacity_factor 0.5 -> C = ceil(0.5*4*2/2) = 2 per expert.
    # First choices: t0->e1, t1->e0, t2->e0, t3->e0; second: t0->e0, t1..t3->e1.
    experts_Tk = torch.tensor([[1, 0], [0, 1], [0, 1], [0, 1]])
    # Choice-major order: e0 keeps first choices of t1, t2 and drops t3's first choice and
    # t0's second; e1 keeps t0's first choice and t1's second, drops t2's and t3's second.
    expected = torch.tensor([[True, False], [True, True], [True, False], [False, False]])
    assert torch.equal(keep_mask(experts_Tk, 2, 0.5), expected)


def test_fully_dropped_token_gets_zero_output():
    moe = make_moe(num_experts=2, top_k=1, capacity_factor=0.5)  # C = ceil(0.5*4/2) = 1
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([[1.0] + [0.0] * 7, [-1.0] + [0.0] * 7]))
    x = torch.zeros(4, 8)
    x[:, 0] = 1.0  # every token prefers expert 0; only token 0 fits
    out, _ = moe(x)
    assert moe.last_stats["dropped"].item() == 3
    assert out[0].abs().sum() > 0 and torch.all(out[1:] == 0)


def test_dropless_drops_nothing_and_matches_dense_mixture():
    moe = make_moe(top_k=2, capacity_factor=None)
    x = torch.randn(2, 10, 8)
    out, _ = moe(x)
    assert moe.last_stats["dropped"].item() == 0
    assert moe.last_stats["tokens_per_expert"].sum().item() == 20 * 2
    # The same output computed naively: every token through its top-2 experts.
    x_TD = x.reshape(-1, 8)
    _, gates, experts = route(x_TD @ moe.router.weight.T, 2)
    naive = torch.stack([sum(g * moe.experts[str(int(e))](t[None])[0] for g, e in zip(gs, es, strict=True))
                         for t, gs, es in zip(x_TD, gates, experts, strict=True)])
    torch.testing.assert_close(out.reshape(-1, 8), naive, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["aux", "z"])
def test_aux_and_z_gradients_reach_the_router(which):
    moe = make_moe(top_k=2, aux_loss_coef=1.0 if which == "aux" else 0.0,
                   z_loss_coef=1.0 if which == "z" else 0.0)
    x = torch.randn(16, 8)
    _, aux = moe(x)
    aux.backward()
    grad = moe.router.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    # finite difference on one router weight agrees with autograd
    eps, i, j = 1e-3, 1, 2
    with torch.no_grad():
        w = moe.router.weight
        w[i, j] += eps
        plus = moe(x)[1].item()
        w[i, j] -= 2 * eps
        minus = moe(x)[1].item()
        w[i, j] += eps
    assert abs((plus - minus) / (2 * eps) - grad[i, j].item()) < 1e-3 * max(1.0, abs(grad[i, j]))


def test_aux_loss_is_one_for_perfect_balance():
    # uniform router probabilities and balanced counts give aux = E * sum(1/E * 1/E) = 1
    logits = torch.zeros(4, 4)
    probs = logits.softmax(-1)
    experts = torch.tensor([[0], [1], [2], [3]])
    aux, z = aux_losses(logits, probs, experts, 4)
    assert aux.item() == pytest.approx(1.0)
    assert z.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)


@pytest.mark.parametrize("k", [1, 3])
def test_any_top_k(k):
    moe = make_moe(top_k=k)
    out, _ = moe(torch.randn(6, 8))
    assert out.shape == (6, 8)
    assert moe.last_stats["tokens_per_expert"].sum().item() == 6 * k


def test_wraps_any_expert_module_and_tags_global_indices():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x).relu()

    moe = MoE(8, Tiny(), num_experts=4, ep_size=2, ep_rank=1, expert_group_name="mine")
    assert sorted(moe.experts) == ["2", "3"]
    tags = {n: expert_tag(p) for n, p in moe.named_parameters()}
    assert tags["router.weight"] is None
    assert tags["experts.3.proj.bias"].expert == 3
    assert tags["experts.2.proj.weight"].group_name == "mine"
    # copies are re-initialised, not clones of one another
    assert not torch.equal(moe.experts["2"].proj.weight, moe.experts["3"].proj.weight)
