"""The optimizer groups the engine really steps equal the plan (issue 4).

The plan is recomputed here, independently of ``moezero.zero.groups``, from the model's
parameters (``moezero.plan.plan_groups`` / ``plan_partitions``); the engine's layout (group
names, member slices, this rank's partition range, the sizes of its master and moment
tensors, the flat buffers the params view) must match it at W = 1, 2, 4, and
``param_groups.json`` written by ``train()`` must agree with the engine that run built.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist

import moezero.train as train_module
from moezero.config import Config
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.plan import ParamSpec, plan_groups, plan_partitions
from moezero.train import build_model
from tests.support.world import run_world
from tests.torch_impl.test_distributed import small_config

_EXPERT = re.compile(r"^(.+)\.experts\.(\d+)\.(.+)$")


def cfg_for(*, stage: int, ep: int, cap: int | None, split: bool) -> dict:
    cfg = small_config(ep_size=ep, max_group_size=cap, split_groups_by_expert=split)
    cfg.zero_optimization.stage = stage
    cfg.zero_optimization.reduce_bucket_size = 2500
    return cfg.model_dump(by_alias=True)


def expected_groups(model, cfg: Config, world: int, rank: int) -> list[dict]:
    """This rank's groups per the plan, from specs built here (every expert, global index)."""
    specs = {}
    for fqn, p in model.named_parameters():
        user_group = "no_decay" if p.ndim < 2 else "decay"
        match = _EXPERT.match(fqn)
        if match is None:
            specs[fqn] = ParamSpec(fqn, tuple(p.shape), user_group=user_group)
            continue
        for e in range(cfg.moe.num_experts):
            name = f"{match[1]}.experts.{e}.{match[3]}"
            specs[name] = ParamSpec(name, tuple(p.shape), user_group=user_group,
                                    moe_group=cfg.moe.group_name, ep_size=cfg.moe.ep_size,
                                    layer=match[1], expert=e)
    plan = plan_groups(list(specs.values()), max_group_size=cfg.moe.max_group_size,
                       split_by_expert=cfg.moe.split_groups_by_expert)
    rows = []
    for group, part in zip(plan, plan_partitions(plan, world_size=world), strict=True):
        if rank in part.ranks:
            d = part.dp_rank(rank)
            rows.append({"index": group.index, "name": group.name, "dp_rank": d,
                         "members": [(m.fqn, m.start, m.stop) for m in group.members],
                         "range": part.rank_range(d), "ranks": list(part.ranks),
                         "shard": part.shard_numel})
    return rows


def engine_facts(cfg_data: dict) -> dict:
    cfg = Config.model_validate(cfg_data)
    topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
    out = {"rank": topo.rank, "local": [g.name for g in engine.groups.local],
           "expected": expected_groups(engine.model, cfg, topo.world_size, topo.rank)}
    out["layout"] = engine.optimizer.layout()
    out["replicated"] = cfg.zero_optimization.stage == 0
    out["storage"] = storage_facts(engine)
    return out


def storage_facts(engine) -> dict:
    """Per kind: do its params all view its flat buffer, and do they fill it exactly?"""
    facts = {}
    for kind in engine.optimizer.kinds:
        ptr = kind.params.untyped_storage().data_ptr()
        mine = [p for p in engine.params.values() if p.untyped_storage().data_ptr() == ptr]
        facts[kind.name] = (sum(p.numel() for p in mine), kind.params.numel())
    facts["all_params_in_buffers"] = sum(n for n, _ in facts.values()) == sum(
        p.numel() for p in engine.params.values())
    return facts


def world_cases(world: int) -> list[dict]:
    return [cfg_for(stage=0, ep=min(2, world), cap=None, split=True),
            cfg_for(stage=1, ep=min(2, world), cap=None, split=True),
            cfg_for(stage=2, ep=world, cap=1000, split=False),
            cfg_for(stage=2, ep=1, cap=700, split=True)]


def all_cases(cases: list[dict]) -> list[dict]:
    return [engine_facts(c) for c in cases]


def check(facts: dict) -> None:
    expected = facts["expected"]
    assert facts["local"] == [e["name"] for e in expected]
    layout = facts["layout"]
    assert [r["name"] for r in layout] == [e["name"] for e in expected]
    for got, want in zip(layout, expected, strict=True):
        for key in ("index", "members", "dp_rank", "range", "ranks"):
            assert got[key] == want[key], (got["name"], key, got[key], want[key])
        sizes = {got[k] for k in ("master", "exp_avg", "exp_avg_sq", "grad")}
        # stage 0 keeps every group whole; the sharded stages keep this rank's shard
        numel = sum(stop - start for _, start, stop in want["members"])
        assert sizes == {numel if facts["replicated"] else want["shard"]}, (got["name"], sizes)
    storage = facts["storage"]
    assert storage.pop("all_params_in_buffers")
    for name, (in_params, flat) in storage.items():
        assert in_params == flat, name  # params fill their flat buffer; no padding inside


@pytest.mark.parametrize("world", [1, 2, 4])
def test_engine_steps_the_plan(tmp_path, world):
    results = run_world(all_cases, world, tmp_path, world_cases(world), timeout_s=240)
    for rank_results in results:
        for facts in rank_results:
            check(facts)
    # the capped stage-2 case really slices a parameter across groups
    layout = results[0][3]["layout"]
    assert any(r["members"][0][1] > 0 for r in layout)


def train_and_capture(cfg_data: dict, run_dir: str) -> dict:
    """Run ``train()`` and return the layout of the engine it built, with param_groups.json."""
    built = []
    original = train_module.initialize

    def capture(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    train_module.initialize = capture
    try:
        train_module.train(Config.model_validate(cfg_data), run_dir)
    finally:
        train_module.initialize = original
    if dist.is_initialized():
        dist.barrier()
    table = json.loads((Path(run_dir) / "param_groups.json").read_text())
    return {"rank": built[0].topology.rank, "layout": built[0].optimizer.layout(), "table": table}


def test_param_groups_json_matches_the_engine(tmp_path):
    cfg = Config.model_validate(cfg_for(stage=2, ep=2, cap=1000, split=True))
    cfg.train.steps = 1
    results = run_world(train_and_capture, 2, tmp_path, cfg.model_dump(by_alias=True),
                        str(tmp_path / "run"))
    for res in results:
        rows = {row["name"]: row for row in res["table"]}
        held = [name for name, row in rows.items() if str(res["rank"]) in row["rank_ranges"]]
        assert [g["name"] for g in res["layout"]] == held
        for g in res["layout"]:
            row = rows[g["name"]]
            assert row["index"] == g["index"]
            assert [(m["fqn"], m["start"], m["stop"]) for m in row["members"]] == g["members"]
            assert tuple(row["rank_ranges"][str(res["rank"])]) == tuple(g["range"])
            assert row["padded_numel"] == g["master"] * len(row["rank_ranges"])
