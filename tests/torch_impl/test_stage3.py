"""ZeRO-3 (torch_impl/zero/gather.py) and offload (torch_impl/offload/): the same parameters,
bit for bit, as stage 2 without offload, for every applicable (param, optimizer) offload
pair; params at rest are shards only; experts that get no token do not hang.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moezero.cli import main
from moezero.model.moe import MoE
from tests.support.world import run_world
from tests.torch_impl.test_cli import TINY, moezero
from tests.torch_impl.test_distributed import MICRO
from tests.torch_impl.test_zero import CAP, engine_and_batches, zcfg

STEPS = 10


def offload_cfg(stage: int, param: str = "none", optim: str = "none", *, dtype: str = "fp32",
                nvme: str | None = None, cap: int | None = CAP, **moe) -> dict:
    cfg = zcfg(stage=stage, ep=2, dtype=dtype, cap=cap)
    cfg["moe"].update(moe)
    for key, device in (("offload_param", param), ("offload_optimizer", optim)):
        cfg["zero_optimization"][key] = {"device": device,
                                         "nvme_path": nvme if device == "nvme" else None}
    return cfg


def train(cfg_data: dict, steps: int = STEPS, world_of_batch: int = 2, first: int = 0,
          load: str | None = None, save: str | None = None) -> dict:
    """Optimizer steps ``first``..``steps``-1 on this rank's slices of the global batch
    (resuming from ``load``; saving to ``save`` at the end); full params, losses, swap files."""
    engine, topo, batches = engine_and_batches(cfg_data, world_of_batch)
    if load:
        engine.load_checkpoint(load)
    for _ in range(first):
        batches.next()
    losses, counts, at_rest = [], [], None
    for _ in range(first, steps):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        metrics = engine.train_step(list(slices[topo.rank::topo.world_size]))
        losses.append(metrics["loss"])
        counts.append([m.last_stats["tokens_per_expert"].tolist() for m in engine.model.modules()
                       if isinstance(m, MoE)])
        if at_rest is None:
            at_rest = sum(p.untyped_storage().nbytes() for p in engine.params.values())
    if save:
        engine.save_checkpoint(save)
    params = {k: p.detach().float().clone().numpy() for k, p in engine.full_parameters().items()}
    opt = engine.optimizer
    gatherer = getattr(opt, "gatherer", None)
    ahead = (gatherer.ahead, gatherer.unit_bytes) if gatherer else None
    swaps = [s.folder for s in (opt.optim_swap, getattr(opt, "param_swap", None)) if s]
    listing = sorted({entry for folder in swaps for entry in folder.listing()})
    engine.close()
    left = sorted({entry for folder in swaps for entry in folder.listing()})
    return {"losses": losses, "params": params, "at_rest_param_bytes": at_rest, "counts": counts,
            "swap_files": listing, "swap_left": left, "ahead": ahead}


def run_cases(cases: dict) -> dict:
    return {name: train(*args) for name, args in cases.items()}


def _assert_same(got: dict, want: dict) -> None:
    assert got["losses"] == want["losses"]
    for fqn, value in want["params"].items():
        assert np.array_equal(got["params"][fqn], value), fqn


PAIRS = [("none", "none"), ("none", "cpu"), ("cpu", "cpu"), ("cpu", "none"),
         ("nvme", "nvme"), ("none", "nvme"), ("nvme", "none"), ("cpu", "nvme"), ("nvme", "cpu")]


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp("swap"))
    cases = {}
    for dtype in ("fp32", "bf16"):
        cases[f"s2_{dtype}"] = (offload_cfg(2, dtype=dtype),)
        for param, optim in PAIRS:
            cases[f"s3_{param}_{optim}_{dtype}"] = (offload_cfg(3, param, optim, dtype=dtype,
                                                                nvme=nvme),)
    cases["s3_nocap"] = (offload_cfg(3, cap=None),)
    cases["s2_nocap"] = (offload_cfg(2, cap=None),)
    for stage, optim in ((1, "cpu"), (1, "nvme"), (2, "cpu"), (2, "nvme")):
        cases[f"s{stage}_optim_{optim}"] = (offload_cfg(stage, optim=optim, nvme=nvme),)
    # capacity 0.25 with 8 experts: some experts get no token on some ranks in some steps
    for stage in (2, 3):
        cases[f"s{stage}_starved"] = (offload_cfg(stage, num_experts=8, capacity_factor=0.25),)
    # the same nvme config twice: the same swap files
    cases["s3_nvme_again"] = cases["s3_nvme_nvme_fp32"]
    return run_world(run_cases, 2, tmp_path_factory.mktemp("w2"), cases, timeout_s=600)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("param,optim", PAIRS)
def test_stage3_offload_bit_identical_to_stage2(w2, dtype, param, optim):
    for rank in w2:
        _assert_same(rank[f"s3_{param}_{optim}_{dtype}"], rank[f"s2_{dtype}"])


def test_stage3_without_group_cap(w2):
    for rank in w2:
        _assert_same(rank["s3_nocap"], rank["s2_nocap"])


def test_stage3_params_at_rest_are_freed(w2):
    """Between steps a stage-3 rank holds no full parameter (only the shards)."""
    for rank in w2:
        assert rank["s3_none_none_fp32"]["at_rest_param_bytes"] == 0
        assert rank["s2_fp32"]["at_rest_param_bytes"] > 0


@pytest.mark.parametrize("name", ["s1_optim_cpu", "s1_optim_nvme", "s2_optim_cpu", "s2_optim_nvme"])
def test_optimizer_offload_at_stages_1_and_2(w2, name):
    for rank in w2:
        _assert_same(rank[name], rank["s2_fp32"])


def test_experts_without_tokens(w2):
    # kept tokens per (step, layer, global expert), summed over the ranks that sent them
    received = np.sum([rank["s3_starved"]["counts"] for rank in w2], axis=0)
    assert (received == 0).any(), "no expert went without tokens: the case tests nothing"
    for rank in w2:
        _assert_same(rank["s3_starved"], rank["s2_starved"])


def test_swap_files_are_stable_and_removed_at_clean_exit(w2):
    for rank in w2:
        first, again = rank["s3_nvme_nvme_fp32"], rank["s3_nvme_again"]
        assert first["swap_files"] and first["swap_files"] == again["swap_files"]
        names = [name for name, _ in first["swap_files"]]
        assert all(name.endswith(".swap") for name in names)
        # fp32, both tiers in one folder: the params are read from the master files
        assert {n.rsplit(".", 2)[-2] for n in names} == {"master", "exp_avg", "exp_avg_sq", "grad"}
        bf16 = {n.rsplit(".", 2)[-2] for n, _ in rank["s3_nvme_nvme_bf16"]["swap_files"]}
        assert bf16 == {"master", "exp_avg", "exp_avg_sq", "grad", "param"}
        assert first["swap_left"] == [] and again["swap_left"] == []


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """4 steps under one offload mode, saved; new processes load it under the other mode and
    run steps 5-10."""
    nvme, ckpt = tmp_path_factory.mktemp("swap_ckpt"), tmp_path_factory.mktemp("ckpt")
    modes = {"nvme": offload_cfg(3, "nvme", "nvme", nvme=str(nvme)), "none": offload_cfg(3)}
    saves = {m: (cfg, 4, 2, 0, None, str(ckpt / m)) for m, cfg in modes.items()}
    run_world(run_cases, 2, tmp_path_factory.mktemp("save"), saves, timeout_s=300)
    loads = {f"{m}_from_{other}": (modes[m], STEPS, 2, 4, str(ckpt / other), None)
             for m, other in (("none", "nvme"), ("nvme", "none"))}
    # another group cap: the groups differ, so NVMe state is read per tensor and written
    loads["nvme_nocap_from_none"] = (offload_cfg(3, "nvme", "nvme", nvme=str(nvme), cap=None),
                                     STEPS, 2, 4, str(ckpt / "none"), None)
    return run_world(run_cases, 2, tmp_path_factory.mktemp("load"), loads, timeout_s=300)


@pytest.mark.parametrize("name", ["none_from_nvme", "nvme_from_none"])
def test_checkpoint_moves_between_nvme_and_memory_bitwise(w2, resumed, name):
    for rank, uninterrupted in zip(resumed, w2, strict=True):
        want = uninterrupted["s3_none_none_fp32"]
        _assert_same(rank[name], {**want, "losses": want["losses"][4:]})


NVME = ["--set", "zero_optimization.stage=3",
        "--set", "zero_optimization.offload_optimizer.device=nvme",
        "--set", "zero_optimization.offload_param.device=nvme"]


def _nvme_at(path) -> list[str]:
    return [*NVME, "--set", f"zero_optimization.offload_optimizer.nvme_path={path}",
            "--set", f"zero_optimization.offload_param.nvme_path={path}"]


def test_cli_trains_stage3_on_nvme_and_leaves_no_swap_file(tmp_path):
    swap = tmp_path / "nvme"
    swap.mkdir()
    res = moezero("train", *TINY, "--set", "train.steps=3", *_nvme_at(swap),
                  "--out", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    assert "stage=3" in res.stdout
    assert list(swap.iterdir()) == []  # moezero-swap/ removed at the clean exit
    ckpt = tmp_path / "run" / "checkpoints" / "latest"
    assert main(["checkpoint", "verify", str(ckpt.parent)]) == 0  # in process: CI time


@pytest.mark.parametrize("where,problem", [
    ("missing", "no such directory"),
    ("file", "not a directory"),
    ("small", "only"),  # a model whose state outgrows the disk: "... only N bytes free"
])
def test_bad_nvme_path_is_one_line_before_any_rank_starts(tmp_path, where, problem):
    path = tmp_path / "swap"
    if where == "file":
        path.write_text("not a folder")
    huge = ["--set", "model.dim=16384", "--set", "model.ffn_dim=65536", "--set",
            "model.n_heads=128"] if where == "small" else []
    if where == "small":
        path.mkdir()
    res = moezero("train", *TINY, *huge, *_nvme_at(path), "--out", str(tmp_path / "run"))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "zero_optimization.offload_optimizer.nvme_path" in lines[0] and problem in lines[0]
    assert not (tmp_path / "run").exists()
    assert not path.is_dir() or list(path.iterdir()) == []  # nothing written there either


def test_checkpoint_reshards_into_nvme(w2, resumed):
    """Loaded under another group cap: the same state, then steps that differ only by the
    summation order of the grad norm."""
    for rank, uninterrupted in zip(resumed, w2, strict=True):
        want, got = uninterrupted["s3_none_none_fp32"], rank["nvme_nocap_from_none"]
        np.testing.assert_allclose(got["losses"], want["losses"][4:], rtol=1e-5)
        for fqn, value in want["params"].items():
            np.testing.assert_allclose(got["params"][fqn], value, rtol=1e-4, atol=1e-6, err_msg=fqn)
