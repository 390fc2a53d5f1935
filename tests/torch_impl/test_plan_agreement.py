"""Plans agree or fail (issue 15, item 6): experts of different shapes (``MoE`` given an expert
factory per global index) are planned from each expert's own shapes on every rank, including
the experts other EP ranks hold; at start-up the ranks compare a digest of their plans and stop
with one line when they differ.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moezero.config import Config
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.model.moe import MoE, SwiGLU
from moezero.model.specs import config_user_group, param_specs
from moezero.zero.groups import PlanMismatchError
from tests.support.world import run_world
from tests.torch_impl.test_distributed import small_config

DIM, EXPERTS = 8, 4


def hidden_of(e: int) -> int:
    return 4 * (e + 1)  # every expert its own width


class Net(nn.Module):
    """A linear layer and one MoE layer; the loss is a regression on one-hot tokens."""

    def __init__(self, expert, *, ep: int, topology):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = MoE(DIM, expert, num_experts=EXPERTS, top_k=2, ep_size=ep,
                       ep_rank=topology.ep_rank(ep), ep_group=topology.ep_group(ep))

    def loss(self, batch_BS1: torch.Tensor):
        x = F.one_hot(batch_BS1[:, :-1] % DIM, DIM).float()
        y, aux = self.moe(self.inp(x))
        ce = (y - x).square().mean()
        return ce + aux, {"ce": ce.detach(), "aux_loss": aux.detach()}


def _config(ep: int, cap: int | None = None) -> Config:
    cfg = small_config(ep_size=ep, num_experts=EXPERTS, max_group_size=cap)
    cfg.optimizer.warmup_steps = 0
    return cfg


def _engine(expert, ep: int, cap: int | None = None):
    cfg = _config(ep, cap)
    topo = build_topology([ep], num_experts=EXPERTS)
    torch.manual_seed(0)
    return initialize(Net(expert, ep=ep, topology=topo), cfg, topology=topo, device="cpu")


def _expert_shapes(model) -> dict[str, tuple[int, ...]]:
    specs, _ = param_specs(model, config_user_group(_config(1)))
    return {s.fqn: s.shape for s in specs if s.expert is not None}


def _want() -> dict[str, tuple[int, ...]]:
    out = {}
    for e in range(EXPERTS):
        h = hidden_of(e)
        out.update({f"moe.experts.{e}.w1.weight": (h, DIM), f"moe.experts.{e}.w3.weight": (h, DIM),
                    f"moe.experts.{e}.w2.weight": (DIM, h)})
    return out


def _step(engine) -> float:
    batch = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    return engine.train_step([batch])["loss"]


def test_a_factory_of_different_experts_is_planned_from_their_own_shapes():
    engine = _engine(lambda e: SwiGLU(DIM, hidden_of(e)), ep=1)
    assert _expert_shapes(engine.model) == _want()
    sizes = {g.expert: g.numel for g in engine.groups.plan if g.expert is not None}
    assert sizes == {e: 3 * DIM * hidden_of(e) for e in range(EXPERTS)}
    assert torch.isfinite(torch.tensor(_step(engine)))


def _factory_world() -> dict:
    engine = _engine(lambda e: SwiGLU(DIM, hidden_of(e)), ep=2)
    return {"shapes": _expert_shapes(engine.model), "plan": engine.groups.plan,
            "loss": _step(engine)}


def test_every_rank_plans_every_expert_from_its_own_shapes(tmp_path):
    """At ep = 2 each rank holds two experts; the other two are planned from the factory."""
    ranks = run_world(_factory_world, 2, tmp_path, timeout_s=60)
    assert ranks[0]["shapes"] == ranks[1]["shapes"] == _want()
    assert ranks[0]["plan"] == ranks[1]["plan"] and ranks[0]["loss"] == ranks[1]["loss"]


def _rank_dependent_template() -> str:
    """A template expert whose width depends on the rank: the ranks' plans differ."""
    try:
        _engine(SwiGLU(DIM, 4 + 4 * dist.get_rank()), ep=2)
    except PlanMismatchError as exc:
        return str(exc)
    return "no error"


def test_ranks_whose_plans_differ_stop_with_one_line(tmp_path):
    messages = run_world(_rank_dependent_template, 2, tmp_path, timeout_s=60)
    assert messages[0] == messages[1], messages
    assert "\n" not in messages[0] and "optimizer plans differ across ranks" in messages[0]
    assert "rank 0" in messages[0] and "rank 1" in messages[0], messages[0]


def test_an_expert_that_cannot_be_sized_is_refused_in_one_line():
    def factory(e: int) -> nn.Module:
        if torch.empty(0).device.type == "meta":
            raise RuntimeError("needs real weights")
        return SwiGLU(DIM, 4)

    # EP rank 0 of 2: experts 0 and 1 are built here, 2 and 3 would be sized on the meta device
    model = nn.ModuleDict({"moe": MoE(DIM, factory, num_experts=EXPERTS, ep_size=2, ep_rank=0)})
    with pytest.raises(ValueError, match=r"^moe: expert 2: cannot be built on the meta device "
                                         r"to read its shapes: .*needs real weights"):
        param_specs(model, config_user_group(_config(2)))
