"""Frozen parameters (``train.freeze``, docs/grouping.md "Frozen parameters"): at W=2, stages
0-3 and offload none/cpu/nvme, frozen parameters are bit-identical after training, the trained
ones equal the W=1 stage-0 run with the same freeze, the optimizer holds no state of frozen
parameters (a rank's persistent engine bytes shrink by exactly their share), and a checkpoint
holds their weights only, says which are frozen and reloads at another W / stage.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np
import pytest
import torch

from moezero.cli import main
from moezero.config import Config, ConfigError
from moezero.distributed.topology import build_topology
from moezero.plan.rules import parse_expert_fqn
from moezero.train import build_model
from moezero.zero.groups import build_groups
from tests.support.compare import assert_close_by_fqn
from tests.support.world import run_world
from tests.torch_impl.test_cli import TINY, moezero
from tests.torch_impl.test_distributed import MICRO, merged
from tests.torch_impl.test_stage3 import offload_cfg
from tests.torch_impl.test_zero import engine_and_batches
from tests.torch_impl.tolerances import RTOL

STEPS = 2
# a dense param alone, the embedding (the first unit: no input gradient), every router and
# one expert of EP rank 1 (experts 2, 3 at ep=2)
FREEZE = ["embed.*", "*.router.*", "layers.1.moe.experts.2.*", "layers.0.attn.wq.*"]
BYTES = ["s0_none", "s1_none", "s2_none", "s2_cpu", "s3_none", "s3_cpu"]
"""Runs whose engine bytes are compared with an unfrozen twin. A rank no longer holds, per
frozen element of its share, 12 fp32 bytes (gradient shard, exp_avg, exp_avg_sq); stage 0
the same per element it holds (it replicates); stage 1 also its full local gradient (4 B per
element held). The fp32 master is the params' own range or the stage-3 param shard, which a
frozen group keeps as its weights (on a CPU, ``cpu`` offload puts it on the same device)."""


def cfg_of(stage: int, offload: str, freeze: list[str], nvme: str | None, ep: int = 2) -> dict:
    param = offload if stage == 3 else "none"
    cfg = offload_cfg(stage, param, offload if stage else "none", nvme=nvme, cap=None)
    cfg["train"]["freeze"] = freeze
    cfg["moe"]["ep_size"] = ep
    return cfg


def train(cfg_data: dict, world_of_batch: int = 2, save: str | None = None,
          load: str | None = None) -> dict:
    """STEPS steps (after loading ``load``), full params before and after, engine bytes."""
    engine, topo, batches = engine_and_batches(cfg_data, world_of_batch)
    if load:
        engine.load_checkpoint(load)
        loaded = _full(engine)
        engine.close()
        return {"loaded": loaded}
    initial = _full(engine)
    for _ in range(STEPS):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        engine.train_step(list(slices[topo.rank::topo.world_size]))
    stateful = {piece.fqn for piece, _ in engine.optimizer.state_pieces()}
    swap = engine.optimizer.optim_swap
    swapped = [name for name, _ in swap.folder.listing()] if swap else []
    if save:
        engine.save_checkpoint(save)
    out = {"initial": initial, "params": _full(engine), "persistent": engine.meter.persistent,
           "stateful": stateful, "optim_swap": swapped, "ep_rank": topo.rank % 2}
    engine.close()
    return out


def _full(engine) -> dict:
    return {k: p.detach().float().clone().numpy() for k, p in engine.full_parameters().items()}


def run_cases(cases: dict) -> dict:
    return {name: train(*args) for name, args in cases.items()}


def frozen(fqns) -> set[str]:
    return {f for f in fqns if any(fnmatchcase(f, p) for p in FREEZE)}


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp("swap"))
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    cases = {}
    for stage, offload in ((0, "none"), (1, "none"), (2, "none"), (2, "cpu"), (3, "none"),
                           (3, "cpu"), (3, "nvme")):
        name = f"s{stage}_{offload}"
        cases[name] = (cfg_of(stage, offload, FREEZE, nvme), 2,
                       ckpt + "/s2" if name == "s2_none" else None)
        if name in BYTES:
            cases[f"{name}_all"] = (cfg_of(stage, offload, [], nvme),)
    cases["s3_nvme_loads_s2"] = (cfg_of(3, "nvme", FREEZE, nvme), 2, None, ckpt + "/s2")
    res = run_world(run_cases, 2, tmp_path_factory.mktemp("w2"), cases, timeout_s=400)
    return res, Path(ckpt)


@pytest.fixture(scope="module")
def w1(tmp_path_factory, w2):
    ckpt = str(w2[1] / "s2")
    cases = {"oracle": (cfg_of(0, "none", FREEZE, None, ep=1), 2),
             "s0_loads_s2": (cfg_of(0, "none", FREEZE, None, ep=1), 2, None, ckpt),
             "unfrozen_loads_s2": (cfg_of(1, "none", [], None, ep=1), 2, None, ckpt)}
    (res,) = run_world(run_cases, 1, tmp_path_factory.mktemp("w1"), cases)
    return res


NAMES = ["s0_none", "s1_none", "s2_none", "s2_cpu", "s3_none", "s3_cpu", "s3_nvme"]


@pytest.mark.parametrize("name", NAMES)
def test_frozen_params_are_bit_identical_and_the_rest_trains_as_at_w1(w2, w1, name):
    runs = [r[name] for r in w2[0]]
    for run in runs:
        fro = frozen(run["params"])
        assert fro and all(np.array_equal(run["params"][f], run["initial"][f]) for f in fro)
        moved = [f for f in set(run["params"]) - fro
                 if not np.array_equal(run["params"][f], run["initial"][f])]
        assert len(moved) == len(run["params"]) - len(fro)
        assert not run["stateful"] & fro, "optimizer state of frozen params"
        frozen_files = [f for f in run["optim_swap"] if f.startswith("frozen__")]
        assert all(f.endswith(".param.swap") for f in frozen_files), frozen_files
    assert_close_by_fqn(merged(runs, "params"), w1["oracle"]["params"], RTOL["fp32"])


def grad_flags(cfg_data: dict) -> dict:
    """After one step: each param's ``requires_grad`` and whether it holds a gradient."""
    engine, _, batches = engine_and_batches(cfg_data, 1)
    engine.train_step(list(torch.from_numpy(batches.next()).split(MICRO)))
    out = {f: (p.requires_grad, p.grad is not None) for f, p in engine.params.items()}
    engine.close()
    return out


def test_frozen_params_take_no_gradient(tmp_path):
    """A frozen parameter has ``requires_grad`` False, so backward computes no gradient for
    it (with LoRA: for no base weight); the losses alone cannot show it (issue 38, "what the
    tests do not see": the planted bug left every loss bit-identical)."""
    cases = {f"s{stage}": (cfg_of(stage, "none", FREEZE, None, ep=1),) for stage in (0, 2, 3)}
    (res,) = run_world(run_flags, 1, tmp_path, cases)
    for name, flags in res.items():
        fro = frozen(flags)
        assert fro and {f: flags[f] for f in fro} == {f: (False, False) for f in fro}, name
        assert all(flags[f][0] for f in set(flags) - fro), name


def run_flags(cases: dict) -> dict:
    return {name: grad_flags(*args) for name, args in cases.items()}


@pytest.mark.parametrize("name", BYTES)
def test_engine_bytes_shrink_by_the_frozen_share(w2, name):
    for ranks in w2[0]:
        run, full = ranks[name], ranks[f"{name}_all"]
        held = share = 0
        for fqn in frozen(run["params"]):
            expert = parse_expert_fqn(fqn)
            if expert is None or expert.expert // 2 == run["ep_rank"]:  # held on this rank
                held += run["params"][fqn].size
                share += run["params"][fqn].size // (2 if expert is None else 1)  # EDP size 1
        want = {"s0": 12 * held, "s1": 4 * held + 12 * share}.get(name[:2], 12 * share)
        assert full["persistent"] - run["persistent"] == want


def test_checkpoint_holds_frozen_weights_once_and_says_so(w2):
    ckpt = next(p for p in (w2[1] / "s2").iterdir() if p.name.startswith("step_"))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    names = frozen(manifest["shapes"])
    assert set(manifest["frozen_params"]) == names
    frozen_groups = [g for g in manifest["groups"] if g.get("frozen")]
    assert frozen_groups and all(g["name"].startswith("frozen/") for g in frozen_groups)
    assert {m[0] for g in frozen_groups for m in g["members"]} == names
    optim = [f for f in manifest["files"] if f["kind"] == "optim"]
    assert len(optim) == len(manifest["groups"]) - len(frozen_groups)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert names <= set(index)
    assert not [k for k in index if k.endswith(".exp_avg")]


@pytest.mark.parametrize("name", ["s0_loads_s2", "unfrozen_loads_s2"])
def test_checkpoint_with_frozen_params_reloads_at_w1(w2, w1, name):
    saved = merged([r["s2_none"] for r in w2[0]], "params")
    assert_close_by_fqn(w1[name]["loaded"], saved, 0.0)


def test_checkpoint_with_frozen_params_reloads_at_stage3_nvme(w2):
    saved = merged([r["s2_none"] for r in w2[0]], "params")
    assert_close_by_fqn(merged([r["s3_nvme_loads_s2"] for r in w2[0]], "loaded"), saved, 0.0)


def test_a_freeze_pattern_that_matches_nothing_is_refused():
    cfg = Config()
    cfg.train.freeze = ["*.router.*", "layers.*.moe.gate.*"]
    topo = build_topology([1], num_experts=cfg.moe.num_experts)
    with pytest.raises(ConfigError) as err:
        build_groups(build_model(cfg, topo), cfg, topo)
    assert str(err.value) == ("train.freeze: pattern 'layers.*.moe.gate.*' matches no "
                              "parameter (config)")
    cfg.train.freeze = ["*"]
    with pytest.raises(ConfigError, match="freeze every parameter: nothing to train"):
        build_groups(build_model(cfg, topo), cfg, topo)


def test_cli_trains_with_frozen_params_and_refuses_a_pattern_matching_nothing(tmp_path,
                                                                             capsys):
    """The training through the CLI's own processes; inspect and the refusal in this process
    (``main``: a subprocess each cost a Python and torch start-up, CI time)."""
    out = tmp_path / "run"
    res = moezero("train", *TINY, "--set", "train.steps=2", "--set", "checkpoint.every=2",
                  "--set", 'train.freeze=["*", "!*.experts.*"]', "--out", str(out))
    assert res.returncode == 0, res.stderr
    groups = json.loads((out / "param_groups.json").read_text())
    assert {g["name"].split("/")[1] for g in groups if g.get("frozen")} == {"dense"}
    assert all(g["name"].startswith("moe/") for g in groups if not g.get("frozen"))
    root = out / "checkpoints"
    manifest = json.loads((root / (root / "latest").read_text() / "manifest.json").read_text())
    assert "embed.weight" in manifest["frozen_params"]
    step_dir = root / (root / "latest").read_text()
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(step_dir)]) == 0
    shown = capsys.readouterr().out
    json_bytes = sum(p.stat().st_size for p in step_dir.glob("*.json"))
    assert " frozen), headers " in shown, shown
    assert f"JSON {json_bytes:,}" in shown, shown
    code = main(["train", *TINY, "--set", 'train.freeze=["*.gate.*"]', "--out",
                 str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "train.freeze: pattern '*.gate.*' matches no parameter" in lines[0]
    assert "Traceback" not in err


def test_stage3_keeps_a_unit_gathered_until_its_first_frozen_param_was_used(tmp_path):
    """A block's norm gain is its first param used in forward (alone in its frozen group),
    so its backward comes after every trained gradient of the block has arrived: a unit
    released on its trained gradients alone frees the frozen gain before its backward reads
    it."""
    (res,) = run_world(run_cases, 1, tmp_path,
                       {"s3": (cfg_of(3, "none", ["layers.1.attn_norm.weight"], None, ep=1),),
                        "s0": (cfg_of(0, "none", ["layers.1.attn_norm.weight"], None, ep=1),)})
    assert_close_by_fqn(res["s3"]["params"], res["s0"]["params"], RTOL["fp32"])
