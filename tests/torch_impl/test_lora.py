"""LoRA (``peft.method: lora``, torch_impl/model/lora.py): adapters on attention, the shared
expert and the routed experts (grouped GEMMs), the base frozen. Training at W=2 ep=2, ZeRO
stages 0-3 with offload none/cpu/nvme gives the W=1 stage-0 losses and adapters (fp32
tolerances of the ZeRO parity), the base stays bit-identical, and the optimizer holds the
adapters only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moezero.checkpoint.core import CheckpointError
from moezero.checkpoint.hf import export_hf
from moezero.checkpoint.tools import describe
from moezero.config import Config, ConfigError, load_config
from moezero.distributed.topology import build_topology
from moezero.model.moe import MoE
from moezero.plan import store
from moezero.plan.reading import read_tensors
from moezero.train import build_model, preflight
from tests.support.compare import assert_close_by_fqn, rel_err
from tests.support.world import run_world
from tests.torch_impl.test_distributed import MICRO, merged, small_config
from tests.torch_impl.test_freeze import cfg_of
from tests.torch_impl.test_zero import engine_and_batches
from tests.torch_impl.tolerances import GROUPED_RTOL, RTOL

STEPS = 3
TARGETS = ["attn", "shared", "experts"]


def lora_cfg(stage: int, offload: str, nvme: str | None, ep: int = 2) -> dict:
    cfg = cfg_of(stage, offload, [], nvme, ep=ep)
    cfg["moe"]["shared_ffn_dim"] = 16
    cfg["peft"] = {"method": "lora", "r": 4, "alpha": 8.0, "targets": TARGETS}
    cfg["optimizer"]["lr"] = 1e-2  # the adapters move visibly in a few steps
    return cfg


def train(cfg_data: dict, world_of_batch: int = 2) -> dict:
    engine, topo, batches = engine_and_batches(cfg_data, world_of_batch)
    initial = _full(engine)
    losses = []
    for _ in range(STEPS):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        losses.append(engine.train_step(list(slices[topo.rank::topo.world_size]))["loss"])
    stateful = {piece.fqn for piece, _ in engine.optimizer.state_pieces()}
    out = {"losses": losses, "initial": initial, "params": _full(engine), "stateful": stateful}
    engine.close()
    return out


def _full(engine) -> dict:
    return {k: p.detach().float().clone().numpy() for k, p in engine.full_parameters().items()}


def run_cases(cases: dict) -> dict:
    return {name: train(*args) for name, args in cases.items()}


NAMES = ["s0_none", "s1_none", "s2_cpu", "s2_nvme", "s3_none", "s3_cpu", "s3_nvme"]


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp("swap"))
    cases = {name: (lora_cfg(int(name[1]), name[3:], nvme),) for name in NAMES}
    return run_world(run_cases, 2, tmp_path_factory.mktemp("w2"), cases, timeout_s=500)


@pytest.fixture(scope="module")
def w1(tmp_path_factory):
    (res,) = run_world(run_cases, 1, tmp_path_factory.mktemp("w1"),
                       {"oracle": (lora_cfg(0, "none", None, ep=1), 2)})
    return res["oracle"]


@pytest.mark.parametrize("name", NAMES)
def test_lora_at_w2_ep2_equals_w1_stage0(w2, w1, name):
    runs = [r[name] for r in w2]
    for got, want in zip(runs[0]["losses"], w1["losses"], strict=True):
        assert rel_err(got, want) <= RTOL["fp32"]
    assert w1["losses"][-1] < w1["losses"][0]
    assert_close_by_fqn(merged(runs, "params"), w1["params"], RTOL["fp32"])
    adapters = {f for f in merged(runs, "params") if ".lora_" in f}
    assert any(".experts." in f for f in adapters) and any(".shared." in f for f in adapters)
    # the ranks' optimizer state covers the adapters, and nothing else
    assert set().union(*(run["stateful"] for run in runs)) == adapters
    for run in runs:
        for fqn, value in run["params"].items():
            moved = not np.array_equal(value, run["initial"][fqn])
            assert moved == (fqn in adapters), fqn


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16 at r=4: the padded kernels
def test_fresh_adapters_leave_the_model_unchanged_and_grouped_equals_the_loop(dtype):
    cfg = small_config(ep_size=1)
    cfg.moe.shared_ffn_dim = 16
    topo = build_topology([1], num_experts=4)
    x = torch.randint(0, 32, (2, 17))
    to = torch.float32 if dtype == "fp32" else torch.bfloat16
    base_loss = build_model(cfg, topo).to(to).loss(x)[0]
    cfg.peft.method, cfg.peft.targets, cfg.peft.r = "lora", TARGETS, 4
    model = build_model(cfg, topo).to(to)
    assert torch.equal(model.loss(x)[0], base_loss)
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            if fqn.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(fqn)))
                        * 0.05)
    grads = {}
    for grouped in (True, False):
        for module in model.modules():
            if isinstance(module, MoE):
                module.grouped = grouped
        model.zero_grad()
        loss = model.loss(x)[0]
        loss.backward()
        grads[grouped] = {k: p.grad.clone() for k, p in model.named_parameters()
                          if p.grad is not None}
        grads[grouped]["loss"] = loss.detach()
    assert not torch.equal(grads[True]["loss"], base_loss)
    assert any(".experts." in k and "lora_A" in k for k in grads[True])
    assert_close_by_fqn({k: v.float() for k, v in grads[True].items()},
                        {k: v.float() for k, v in grads[False].items()}, GROUPED_RTOL[dtype])


# ---------------------------------------------------------------------------- checkpoints
def save_base(cfg_data: dict, root: str) -> None:
    """The base model (no adapters) saved at step 0: what import-hf would give."""
    base = {**cfg_data, "peft": {"method": "none"}}
    engine, _, _ = engine_and_batches(base, 2)
    engine.save_checkpoint(root, step=0)
    engine.close()


def lora_steps(cfg_data: dict, load: str, save: str | None = None) -> dict:
    """Load ``load``, train STEPS steps (saving to ``save``), full params before and after."""
    engine, topo, batches = engine_and_batches(cfg_data, 2)
    engine.load_checkpoint(load)
    loaded = _full(engine)
    for _ in range(STEPS if save else 0):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        engine.train_step(list(slices[topo.rank::topo.world_size]))
    if save:
        engine.save_checkpoint(save)
    out = {"loaded": loaded, "params": _full(engine)}
    engine.close()
    return out


def ckpt_cases(calls: list) -> list:
    return [fn(*args) for fn, args in calls]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_ckpt")
    base, adapters = str(root / "base"), str(root / "adapters")
    (base_run,) = run_world(ckpt_cases, 1, root / "w1a",
                            [(save_base, (lora_cfg(0, "none", None, ep=1), base))])
    w2 = run_world(ckpt_cases, 2, root / "w2",
                   [(lora_steps, (lora_cfg(2, "none", None), base, adapters))])
    (w1,) = run_world(ckpt_cases, 1, root / "w1b",
                      [(lora_steps, (lora_cfg(3, "none", None, ep=1), adapters))])
    return root, [r[0] for r in w2], w1[0]


def _step_dir(root: Path) -> Path:
    return root / (root / "latest").read_text()


def test_lora_checkpoint_holds_the_adapters_and_names_its_base(ckpts):
    root, w2, _ = ckpts
    step = _step_dir(root / "adapters")
    manifest = json.loads((step / "manifest.json").read_text())
    base = _step_dir(root / "base")
    assert manifest["base"] == {"path": str(base.resolve()), "sha256": hashlib.sha256(
        (base / "manifest.json").read_bytes()).hexdigest()}
    adapters = {f: v.size for f, v in merged(w2, "params").items() if ".lora_" in f}
    assert set(manifest["shapes"]) == set(adapters)
    files = [f for f in manifest["files"] if f["kind"] in ("model", "optim")]
    data = sum(f["size"] for f in files) - sum(_header_bytes(step / f["name"]) for f in files)
    assert data == 12 * sum(adapters.values())  # master + exp_avg + exp_avg_sq, nothing else


def _header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_lora_checkpoint_resumes_at_w1_stage3_from_its_base_and_adapters(ckpts):
    _, w2, w1 = ckpts
    assert_close_by_fqn(w1["loaded"], merged(w2, "params"), 0.0)


def test_a_changed_base_is_refused_in_one_line(ckpts):
    root, _, _ = ckpts
    base = _step_dir(root / "base") / "manifest.json"
    original = base.read_bytes()
    cfg = Config.model_validate(lora_cfg(0, "none", None, ep=1))
    cfg.checkpoint.load = str(_step_dir(root / "adapters"))
    try:
        base.write_bytes(original.replace(b'"step": 0', b'"step": 0 '))
        with pytest.raises(CheckpointError) as err:
            preflight(cfg, root / "run")
    finally:
        base.write_bytes(original)
    line = str(err.value)
    assert "\n" not in line and line.startswith("checkpoint.load: ")
    assert f"its base checkpoint {base.parent.resolve()} changed since the save" in line
    assert preflight(cfg, root / "run") == Path(cfg.checkpoint.load)


def test_a_target_the_model_lacks_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["peft.method=lora", "peft.targets=[attn, shared]"])
    assert str(err.value).startswith("peft.targets: names the shared expert, but the model has "
                                     "none (moe.shared_ffn_dim is 0)")
    with pytest.raises(ConfigError, match=r"peft.targets.*'attn.wx'"):
        load_config(None, ["peft.method=lora", "peft.targets=[attn.wx]"])


def _bf16_round_trip(root: str) -> dict:
    out = {}
    for stage, offload in ((2, "none"), (3, "cpu")):
        cfg = lora_cfg(stage, offload, None, ep=1)
        cfg["precision"]["dtype"] = "bf16"
        save_base(cfg, f"{root}/base{stage}")
        trained = lora_steps(cfg, f"{root}/base{stage}", f"{root}/adapters{stage}")
        out[stage] = (trained, lora_steps(cfg, f"{root}/adapters{stage}")["loaded"])
    return out


def test_bf16_base_stays_frozen_and_reloads_from_base_and_adapters(tmp_path):
    """bf16 compute: the frozen base lives in bf16 (stage 2, and stage 3 on the host), the
    adapters train (grouped kernels on r=4: padded), and a reload gives the same params."""
    (res,) = run_world(_bf16_round_trip, 1, tmp_path / "w1", str(tmp_path))
    for trained, reloaded in res.values():
        moved = {f for f, v in trained["params"].items()
                 if not np.array_equal(v, trained["loaded"][f])}
        assert moved and all(".lora_" in f for f in moved)
        assert_close_by_fqn(reloaded, trained["params"], 0.0)


def test_an_adapter_checkpoint_is_described_and_not_exported_to_hf_unmerged(ckpts):
    root, _, _ = ckpts
    step, base = _step_dir(root / "adapters"), _step_dir(root / "base")
    assert f"adapters only: the frozen weights are in the base checkpoint {base.resolve()}" \
        in describe(step)
    with pytest.raises(CheckpointError) as err:
        export_hf(step, root / "hf")
    assert "\n" not in str(err.value) and "holds LoRA adapters" in str(err.value)
    assert not (root / "hf").exists()


# ---------------------------------------------------------------------------- "!" patterns
UNFROZEN = ["!*norm.weight", "!*.router.*"]  # base params that a LoRA run trains too


def _trained_base_then_lora(root: str) -> dict:
    """A base trained 2 steps at a high lr (its norm gains and routers leave moezero's fresh
    init), then LoRA runs with ``UNFROZEN`` at stages 0 and 3 loading it: their params before
    and after the load."""
    cfg = lora_cfg(0, "none", None, ep=1)
    base = {**cfg, "peft": {"method": "none"}}
    base["optimizer"] = {**cfg["optimizer"], "lr": 5e-2}
    engine, _, batches = engine_and_batches(base, 1)
    for _ in range(2):
        engine.train_step([torch.from_numpy(batches.next())])
    engine.save_checkpoint(f"{root}/base")
    engine.close()
    out = {}
    for stage, offload in ((0, "none"), (3, "cpu")):
        cfg = lora_cfg(stage, offload, None, ep=1)
        cfg["train"]["freeze"] = UNFROZEN
        engine, _, _ = engine_and_batches(cfg, 1)
        fresh = _full(engine)
        engine.load_checkpoint(f"{root}/base")
        out[stage] = {"fresh": fresh, "loaded": _full(engine)}
        engine.close()
    return out


def test_lora_with_unfrozen_base_params_loads_every_base_param_from_the_base(tmp_path):
    """issue 38 fault 1: with ``train.freeze: ["!..."]`` the un-frozen base params (norm gains,
    routers) come from the base too, not from moezero's fresh init; only the adapters keep
    their initial values."""
    (res,) = run_world(_trained_base_then_lora, 1, tmp_path / "w1", str(tmp_path))
    where = store.find_checkpoint(tmp_path / "base")
    base = read_tensors(where, store.read_manifest(where))
    norms = [f for f in base if f.endswith("norm.weight")]
    routers = [f for f in base if ".router." in f]
    assert norms and routers
    assert all(not np.allclose(base[f], 1.0) for f in norms)  # not HF's nor moezero's init
    for stage, run in res.items():
        assert not any(np.array_equal(run["fresh"][f], base[f].reshape(run["fresh"][f].shape))
                       for f in routers), stage
        for fqn, value in run["loaded"].items():
            if ".lora_" in fqn:
                np.testing.assert_array_equal(value, run["fresh"][fqn], err_msg=fqn)
            else:
                np.testing.assert_array_equal(value, base[fqn].reshape(value.shape),
                                              err_msg=f"stage {stage}: {fqn}")


def test_shared_targets_are_checked_after_the_checkpoints_architecture_is_adopted(tmp_path):
    """issue 38 #12: ``peft.targets=[attn, shared, experts]`` with ``checkpoint.load`` of a
    Qwen2-MoE import (a shared expert) is accepted: the target check runs on the adopted
    architecture; with a Mixtral import (none) it is refused, naming the checkpoint."""
    from moezero.checkpoint.adopt import adopt_architecture
    from moezero.checkpoint.hf import import_hf
    from tests.torch_impl.test_hf_families import hf_model, save_hf

    sets = ["peft.method=lora", "peft.targets=[attn, shared, experts]"]
    for family in ("qwen2_moe", "mixtral"):
        save_hf(hf_model(family), tmp_path / family)
        step = import_hf(tmp_path / family, tmp_path / f"{family}_ckpt")
        cfg = load_config(None, [*sets, f"checkpoint.load={tmp_path / f'{family}_ckpt'}"])
        if family == "qwen2_moe":
            cfg, _ = adopt_architecture(cfg, tmp_path / "run")
            assert cfg.moe.shared_ffn_dim > 0 and "shared" in cfg.peft.targets
            continue
        with pytest.raises(ConfigError) as err:
            adopt_architecture(cfg, tmp_path / "run")
        line = str(err.value)
        assert "\n" not in line and line.startswith(
            "peft.targets: names the shared expert, but the model has none "
            "(moe.shared_ffn_dim is 0)"), line
        assert str(step) in line, line


def test_freezing_the_adapters_of_a_lora_run_is_refused_by_its_cause():
    """issue 38 #12: ``train.freeze: ["*.lora_A"]`` in a LoRA run froze the adapters, and the
    run then failed with 'lora_A is not in the checkpoint'; the pattern is refused instead."""
    from moezero.zero.groups import build_groups

    cfg = Config.model_validate(lora_cfg(0, "none", None, ep=1))
    cfg.train.freeze = ["*.lora_A"]
    topo = build_topology([1], num_experts=cfg.moe.num_experts)
    with pytest.raises(ConfigError) as err:
        build_groups(build_model(cfg, topo), cfg, topo)
    line = str(err.value)
    assert line.startswith("train.freeze: pattern '*.lora_A' freezes the LoRA adapter "
                           "layers.0.attn.wq.lora_A: a LoRA run trains its adapters"), line
