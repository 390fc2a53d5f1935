"""DeepSeek-V3 / GLM-4.5 routing (``moe.n_group``, ``moe.topk_group``,
``moe.routed_scaling_factor``; docs/model.md, "Group-limited routing") against transformers'
own router (``DeepseekV3TopkRouter``, the same code as ``Glm4MoeTopkRouter``): the same experts
and gates for random logits and a random correction bias, and the bad settings refused in one
line naming the key.
"""

from __future__ import annotations

import pytest
import torch

from moezero.config import ConfigError, load_config
from moezero.model.router import Router, RouterOptions, route

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3TopkRouter,
)

E, D, T = 16, 24, 64


def hf_router(n_group: int, topk_group: int, top_k: int, scale: float, norm: bool):
    cfg = transformers.DeepseekV3Config(hidden_size=D, n_routed_experts=E, n_group=n_group,
                                        topk_group=topk_group, num_experts_per_tok=top_k,
                                        routed_scaling_factor=scale, norm_topk_prob=norm)
    router = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(n_group * 10 + top_k)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, D, generator=gen))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(E, generator=gen))
    return router


@pytest.mark.parametrize("n_group, topk_group, top_k, scale, norm", [
    (4, 2, 3, 2.5, True), (8, 3, 4, 1.0, True), (4, 1, 4, 1.5, False), (1, 1, 6, 2.0, True)])
def test_group_limited_choice_and_scaled_gates_equal_transformers(n_group, topk_group, top_k,
                                                                  scale, norm):
    theirs = hf_router(n_group, topk_group, top_k, scale, norm)
    x_TD = torch.randn(T, D, generator=torch.Generator().manual_seed(5))
    logits, their_gates, their_experts = theirs(x_TD)
    _, gates_Tk, experts_Tk = route(
        logits, top_k, scoring="sigmoid", renormalize=norm,
        bias_E=theirs.e_score_correction_bias, groups=(n_group, topk_group), scale=scale)
    # transformers' top-k is unsorted: compare each token's (expert, gate) pairs by expert
    mine_order, their_order = experts_Tk.argsort(-1), their_experts.argsort(-1)
    assert torch.equal(experts_Tk.gather(1, mine_order), their_experts.gather(1, their_order))
    diff = (gates_Tk.gather(1, mine_order) - their_gates.gather(1, their_order)).abs().max()
    assert diff <= 1e-6, diff
    if n_group > 1:  # the groups do limit the choice here
        free = route(logits, top_k, scoring="sigmoid", bias_E=theirs.e_score_correction_bias)[2]
        assert not torch.equal(free.sort(-1)[0], experts_Tk.sort(-1)[0])


def test_the_module_routes_with_its_options():
    opts = RouterOptions("sigmoid", True, True, 0.0, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5)
    theirs = hf_router(4, 2, 3, 2.5, True)
    mine = Router(D, E, 3, opts)
    with torch.no_grad():
        mine.weight.copy_(theirs.weight)
        mine.expert_bias.copy_(theirs.e_score_correction_bias)
    x_TD = torch.randn(T, D, generator=torch.Generator().manual_seed(6))
    _, _, gates, experts = mine(x_TD)
    _, their_gates, their_experts = theirs(x_TD)
    assert torch.equal(experts.sort(-1)[0], their_experts.sort(-1)[0])
    assert torch.allclose(gates.sum(-1), their_gates.sum(-1), atol=1e-6)


@pytest.mark.parametrize("sets, line", [
    (["moe.num_experts=8", "moe.n_group=3"], "moe.n_group: must split the 8 experts"),
    (["moe.num_experts=8", "moe.n_group=8"], "moe.n_group: must split the 8 experts into "
                                             "groups of at least 2"),
    (["moe.num_experts=8", "moe.n_group=2", "moe.topk_group=3"], "moe.topk_group: must be <= "
                                                                  "n_group (2)"),
    (["moe.num_experts=8", "moe.top_k=3", "moe.n_group=4"], "moe.topk_group: its 1 groups of 2"),
    (["moe.routed_scaling_factor=0"], "moe.routed_scaling_factor"),
])
def test_bad_group_settings_are_one_line(sets, line):
    with pytest.raises(ConfigError) as err:
        load_config(None, sets)
    assert line in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="moe.n_group"):
        Router(D, 8, 2, RouterOptions(n_group=3))
