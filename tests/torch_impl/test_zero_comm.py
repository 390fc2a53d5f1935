"""Collectives of one training step (torch_impl/zero/allgather.py, reduce.py): their number does
not grow with the number of optimizer groups (bucketed all-gathers, bucketed reductions), the
bucketed gathers give the same parameters bit for bit as one all-gather per group, and
``zero_optimization.reduce_dtype: bf16`` reduces in bf16.

The counts come from wrapping the ``torch.distributed`` functions in each rank (and every
``moezero`` module's own alias of them), so they see every collective the engine issues.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import numpy as np
import pytest
import torch

from benchmarks.collectives import by_op, counting
from moezero.model.moe import MoE
from moezero.zero.gather import ParamGatherer
from tests.support.world import run_world
from tests.torch_impl.test_distributed import MICRO
from tests.torch_impl.test_zero import engine_and_batches, zcfg
from tests.torch_impl.tolerances import BF16_REDUCE_ATOL

FEW, MANY = None, 100  # moe.max_group_size: ~10 groups, ~600 groups of the same model
STEPS = 3


def first_step(engine, mine: list[torch.Tensor]) -> dict:
    """One step by hand; the reduced gradients (full, by FQN) before it."""
    for batch in mine:
        loss, _ = engine.forward(batch)
        engine.backward(loss)
    engine.reduce_gradients()
    grads = {k: g.detach().float().clone().numpy() for k, g in engine.gradients().items()}
    engine.optimizer_step()
    return grads


def run_case(cfg_data: dict) -> dict:
    """``STEPS`` steps; the first one's reduced gradients, the collectives of the last one,
    the groups, the gather units and the parameters after it."""
    engine, topo, batches = engine_and_batches(cfg_data, 2)
    counts, grads = Counter(), None
    for step in range(STEPS):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        mine = list(slices[topo.rank::topo.world_size])
        if step == 0:
            grads = first_step(engine, mine)
            continue
        with counting() if step == STEPS - 1 else contextlib.nullcontext(Counter()) as seen:
            engine.train_step(mine)
        counts = seen
    opt = engine.optimizer
    gatherer = getattr(opt, "gatherer", None)
    units = len(gatherer.units) if isinstance(gatherer, ParamGatherer) else 0
    moe_layers = sum(isinstance(m, MoE) for m in engine.model.modules())
    params = {k: p.detach().float().clone().numpy() for k, p in engine.full_parameters().items()}
    return {"counts": dict(counts), "grads": grads, "groups": len(opt.slots), "units": units,
            "reduce_buckets": len(opt.reduction.buckets), "moe_layers": moe_layers,
            "params": params}


def run_cases(cases: dict) -> dict:
    return {name: run_case(cfg) for name, cfg in cases.items()}


def case(stage: int, cap: int | None, *, ep: int = 1, gather: int | None | str = "default",
         reduce_dtype: str = "fp32", dtype: str = "fp32", experts: int = 4) -> dict:
    cfg = zcfg(stage=stage, ep=ep, cap=cap, dtype=dtype, experts=experts)
    cfg["zero_optimization"]["reduce_bucket_size"] = 10**7  # one reduction bucket per kind
    cfg["zero_optimization"]["reduce_dtype"] = reduce_dtype
    if gather != "default":
        cfg["zero_optimization"]["allgather_bucket_size"] = gather
    return cfg


CASES = {
    **{f"s{s}_{n}": case(s, cap) for s in (0, 1, 2, 3) for n, cap in (("few", FEW), ("many", MANY))},
    # the per-group gathers (null) and buckets that cut groups apart (300 elements)
    **{f"s{s}_many_g{g}": case(s, MANY, gather=g) for s in (1, 2, 3) for g in (None, 300)},
    **{f"s{s}_ep2_{g}": case(s, 1000, ep=2, gather=g) for s in (2, 3) for g in (None, "default")},
    **{f"s{s}_{r}": case(s, MANY, reduce_dtype=r) for s in (0, 2) for r in ("fp32", "bf16")},
    "s2_bf16_params_bf16": case(2, MANY, reduce_dtype="bf16", dtype="bf16"),
    # another model: 16 experts instead of 4, capped groups
    **{f"s{s}_e16_many": case(s, MANY, experts=16) for s in (2, 3)},
}


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    return run_world(run_cases, 2, tmp_path_factory.mktemp("comm"), CASES, timeout_s=600)


def _same_params(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for fqn, value in a["params"].items():
        assert np.array_equal(value, b["params"][fqn]), fqn


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_collectives_per_step_do_not_grow_with_groups(w2, stage):
    for rank in w2:
        few, many = rank[f"s{stage}_few"], rank[f"s{stage}_many"]
        assert many["groups"] >= 30 * few["groups"] / 2 and many["groups"] > 300, \
            (few["groups"], many["groups"])
        assert many["reduce_buckets"] == few["reduce_buckets"] == 2  # dense + experts
        got, base = by_op(many["counts"]), by_op(few["counts"])
        if stage < 3:
            assert got == base, (got, base)
            # one bucket per kind: reductions, then (stages 1-2) the parameter all-gathers
            assert got.get("reduce-scatter", 0) + got.get("all-reduce", 0) == 2 + 2
            assert got.get("all-gather", 0) == (2 if stage else 0)
        else:  # at most one bucket per gather unit and pass (forward, backward), no more
            assert got["reduce-scatter"] == 2 and got["all-reduce"] == 2
            assert got["all-gather"] <= 2 * many["units"] < many["groups"] / 20, (got, many["units"])


@pytest.mark.parametrize("stage", [2, 3])
def test_collectives_per_step_of_another_model(w2, stage):
    """16 experts and capped groups (~2,000 groups) against 4 experts in ~10 groups."""
    for rank in w2:
        few, big = rank[f"s{stage}_few"], rank[f"s{stage}_e16_many"]
        assert big["groups"] > 100 * few["groups"], (few["groups"], big["groups"])
        got, base = by_op(big["counts"]), by_op(few["counts"])
        if stage == 2:
            assert got == base, (got, base)
        else:  # the same units (the experts of a layer are one unit, whatever their number)
            assert big["units"] == few["units"] and got["all-gather"] <= 2 * big["units"], got


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("gather", [None, 300])
def test_bucketed_gathers_are_bit_identical_to_per_group_gathers(w2, stage, gather):
    for rank in w2:
        bucketed, other = rank[f"s{stage}_many"], rank[f"s{stage}_many_g{gather}"]
        _same_params(bucketed, other)
        if gather is None:  # the per-group path really gathers group by group
            assert by_op(other["counts"])["all-gather"] >= other["groups"] // 2
        else:  # groups cut across buckets of 300 elements
            assert by_op(other["counts"])["all-gather"] > by_op(bucketed["counts"])["all-gather"]


@pytest.mark.parametrize("stage", [2, 3])
def test_bucketed_gathers_with_expert_parallelism(w2, stage):
    for rank in w2:
        _same_params(rank[f"s{stage}_ep2_default"], rank[f"s{stage}_ep2_None"])


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_reduce_dtype_sends_bf16_and_stays_close(w2, stage):
    for rank in w2:
        fp32, bf16 = rank[f"s{stage}_fp32"], rank[f"s{stage}_bf16"]
        op = "reduce_scatter_single" if stage else "all_reduce"
        reduce32 = {d: n for (name, d), n in fp32["counts"].items() if name.startswith(op[:10])}
        reduce16 = {d: n for (name, d), n in bf16["counts"].items() if name.startswith(op[:10])}
        assert "bfloat16" not in reduce32 and reduce16.get("bfloat16") == 2, (reduce32, reduce16)
        # each gradient rounded to bf16 (8 bits) before and after a sum of two: not equal,
        # but within a few bf16 ulps of the tensor's scale
        worst = max(np.abs(bf16["grads"][k] - g).max() / np.abs(g).max()
                    for k, g in fp32["grads"].items() if np.abs(g).max() > 0)
        assert 0 < worst <= BF16_REDUCE_ATOL, worst
        assert any(not np.array_equal(v, bf16["params"][k]) for k, v in fp32["params"].items())


def test_bf16_reduce_dtype_with_bf16_params(w2):
    for rank in w2:
        got = rank["s2_bf16_params_bf16"]
        assert all(np.isfinite(v).all() for v in got["params"].values())
        assert any(d == "bfloat16" for (name, d) in got["counts"] if "reduce_scatter" in name)
