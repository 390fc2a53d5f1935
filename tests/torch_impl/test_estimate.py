"""``moezero estimate`` (torch_impl/estimate.py) against what the engine really holds.

For small models at W = 1 and 2, stages 0-3 and offload none/cpu/nvme (fp32 and bf16), each
rank builds the real engine and measures: its ``MemoryMeter`` persistent bytes plus the flat
parameter buffers (which the meter does not count), and the sizes of its swap files on disk.
The estimate, computed from the config alone for the same rank, must equal both exactly. A
50-billion-parameter config is estimated in a subprocess whose peak RSS stays far below the
model's bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from moezero.config import Config, load_config
from moezero.estimate import estimate, format_table
from moezero.zero.shards import nbytes
from tests.support.world import run_world
from tests.torch_impl.test_cli import moezero
from tests.torch_impl.test_zero import CAP, engine_and_batches, zcfg


def case(stage: int, *, ep: int = 1, optim: str = "none", param: str = "none",
         dtype: str = "fp32", nvme: str | None = None, cap: int | None = CAP) -> dict:
    cfg = zcfg(stage=stage, ep=ep, dtype=dtype, cap=cap)
    for key, device in (("offload_param", param), ("offload_optimizer", optim)):
        cfg["zero_optimization"][key] = {"device": device,
                                         "nvme_path": nvme if device == "nvme" else None}
    return cfg


def measure(cases: list[dict]) -> list[dict]:
    """On this rank, per config: memory the engine holds at rest and its swap files' bytes."""
    out = []
    for cfg_data in cases:
        engine, topo, _ = engine_and_batches(cfg_data, topo_world())
        opt = engine.optimizer
        flat = sum(nbytes(k.params) for k in opt.kinds if k.params is not None)
        swaps = {s.folder.folder: s.folder for s in (opt.optim_swap, getattr(opt, "param_swap", None))
                 if s}  # one folder when both tiers share an nvme_path
        on_disk = sum(size for folder in swaps.values() for _, size in folder.listing())
        out.append({"rank": topo.rank, "memory": engine.meter.persistent + flat,
                    "nvme": on_disk})
        engine.close()
    return out


def topo_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def check(cases: list[dict], results: list[list[dict]], world: int) -> None:
    for rank_results in results:
        for cfg_data, got in zip(cases, rank_results, strict=True):
            est = estimate(Config.model_validate(cfg_data), world, rank=got["rank"], device="cpu")
            z = cfg_data["zero_optimization"]
            what = (world, z["stage"], cfg_data["moe"]["ep_size"], cfg_data["precision"]["dtype"],
                    z["offload_optimizer"]["device"], z["offload_param"]["device"], got["rank"])
            assert (est.memory_total(), est.tier_total("nvme")) == (got["memory"], got["nvme"]), what
            assert est.tier_total("device") == 0  # the compute device is the host here


def test_estimate_equals_the_engine_at_w1():
    cases = [case(s) for s in (0, 1, 2, 3)] + [case(2, dtype="bf16"), case(3, dtype="bf16")]
    check(cases, [measure(cases)], 1)


def test_estimate_equals_the_engine_at_w2(tmp_path):
    nvme = str(tmp_path / "nvme")
    os.makedirs(nvme)
    cases = [case(0, ep=2), case(1), case(1, ep=2, optim="cpu"), case(2, ep=2, optim="nvme", nvme=nvme),
             case(2, dtype="bf16", optim="cpu"), case(3, ep=2), case(3, ep=2, param="cpu", optim="cpu"),
             case(3, ep=2, param="nvme", optim="nvme", nvme=nvme),
             case(3, param="nvme", optim="none", nvme=nvme, dtype="bf16"),
             case(3, ep=2, param="none", optim="nvme", nvme=nvme, cap=None)]
    check(cases, run_world(measure, 2, tmp_path, cases), 2)


def test_gpu_placement_separates_device_and_host():
    """On a GPU (the default) offloaded state is on the host, the rest on the device; a
    separate fp32 master appears once the state leaves the device (16 B/elem, not 12)."""
    base = Config.model_validate(case(2, dtype="auto"))
    on_device = estimate(base, 2)
    assert on_device.dtype == "bf16" and on_device.tier_total("cpu") == 0
    est = estimate(Config.model_validate(case(2, optim="cpu")), 2)
    shard_elems = est.get("optimizer", "cpu") // 12
    assert est.get("optimizer", "device") == 0 and shard_elems > 0
    assert est.get("grads", "device") == 4 * shard_elems  # the grad partition, padded alike


def test_stage3_nvme_optimizer_puts_the_gradient_partition_on_nvme(tmp_path):
    """zero.gradtier: at stage 3 with the optimizer on NVMe the reduced gradient is a swap file
    (one per group, 4096-rounded), at stages 1-2 it stays in memory."""
    s3 = estimate(Config.model_validate(case(3, optim="nvme", nvme=str(tmp_path))), 2, device="cpu")
    s2 = estimate(Config.model_validate(case(2, optim="nvme", nvme=str(tmp_path))), 2, device="cpu")
    assert s3.get("grads", "cpu") == 0 and s3.get("grads", "nvme") >= s2.get("grads", "cpu") > 0
    assert s3.get("grads", "nvme") % 4096 == 0 and s2.get("grads", "nvme") == 0


HUGE = ["model.dim=8192", "model.n_layers=8", "model.ffn_dim=16384", "model.n_heads=64",
        "moe.num_experts=16", "moe.ep_size=8", "zero_optimization.stage=3",
        "zero_optimization.offload_optimizer.device=cpu",
        "zero_optimization.offload_param.device=cpu"]

_PEAK = """
import sys
import torch
from moezero.config import load_config
from moezero.memory.peak import peak_memory_bytes
from moezero.estimate import estimate
est = estimate(load_config(None, sys.argv[1:]), 8)
print(est.model_numel, peak_memory_bytes(torch.device("cpu")))  # this program's peak (VmHWM)
"""


def test_a_50b_model_is_estimated_without_allocating_it():
    run = subprocess.run([sys.executable, "-c", _PEAK, *HUGE], capture_output=True, text=True,
                         timeout=120, check=True)
    numel, peak = map(int, run.stdout.split())
    assert numel > 50e9
    assert peak < 1.5 * 2**30 < numel * 2  # the bf16 weights alone are 100 GB


def test_cli_prints_the_table_and_rejects_a_bad_world(tmp_path, capsys):
    """The table through the console script; the refusal through ``main`` in this process (a
    second subprocess cost a Python and torch start-up, CI time)."""
    from moezero.cli import main

    args = [f"--set={s}" for s in HUGE]
    run = moezero("estimate", *args, "--nproc", "8")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == format_table(estimate(load_config(None, HUGE), 8))
    lines = run.stdout.splitlines()
    assert lines[0].startswith("moezero estimate: rank 0 of 8, ZeRO stage 3, bf16 on cuda")
    assert [ln.split()[0] for ln in lines[1:6]] == ["GiB", "params", "grads", "optimizer", "total"]
    capsys.readouterr()
    code = main(["estimate", *args, "--nproc", "6"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "moe.ep_size" in err


def test_table_mentions_every_tier():
    text = format_table(estimate(Config.model_validate(case(3, ep=2)), 2, device="cpu"))
    assert "device" in text and "nvme" in text and "largest gather unit" in text


MIXTRAL = Path(__file__).resolve().parents[2] / "torch_impl" / "recipes" / "mixtral-8x7b.yaml"
GIB = 2**30


def mixtral_params() -> int:
    """Mixtral-8x7B's parameters from its published shape (GQA: 8 K/V heads of 128)."""
    d, f, kv, vocab, layers, experts = 4096, 14336, 8 * 128, 32000, 32, 8
    block = 2 * d * d + 2 * d * kv + 2 * d + experts * d + experts * 3 * d * f
    return 2 * vocab * d + layers * block + d


def test_the_mixtral_recipe_fits_8_gpus_of_80_gb():
    """The recipe loads, has Mixtral-8x7B's 46.7 B params, and every rank's predicted device
    peak (state, activations of its micro-batch, transients) stays under 75 GiB of an 80 GB
    GPU, with host memory a node of 8 GPUs has (< 640 GiB for its 8 ranks)."""
    cfg = load_config(MIXTRAL)
    for rank in (0, 7):
        est = estimate(cfg, 8, rank=rank)
        assert est.model_numel == mixtral_params() and round(est.model_numel / 1e9, 1) == 46.7
        assert est.dtype == "bf16" and est.activation_bytes > 0
        assert est.peak("device") < 75 * GIB, format_table(est)
        assert 8 * est.peak("cpu") < 640 * GIB, format_table(est)


def test_the_readme_stage_2_mixtral_example_does_not_fit():
    """What the README once suggested (stage 2, ep = W = 8) keeps 89.6 GiB of state per GPU."""
    est = estimate(load_config(MIXTRAL, ["zero_optimization.stage=2", "moe.max_group_size=null",
                                         "zero_optimization.offload_optimizer.device=none"]), 8)
    assert est.tier_total("device") > 80 * GIB


def test_the_nvme_budgets_are_counted_where_they_hold_memory(tmp_path):
    """keep_for_backward holds gathered units on the compute device through backward;
    keep_grads and read_in_backward hold host buffers from backward into the step. Small
    budgets (below what this model has of each) are counted at their bytes."""
    data = case(3, optim="nvme", param="nvme", nvme=str(tmp_path))
    base = estimate(Config.model_validate(data), 2, device="cuda")
    zero = data["zero_optimization"]
    zero["offload_param"]["keep_for_backward"] = 3000
    zero["offload_optimizer"].update(keep_grads=2000, read_in_backward=1000)
    kept = estimate(Config.model_validate(data), 2, device="cuda")
    grow = lambda tier, phase: kept.phase_total(phase, tier) - base.phase_total(phase, tier)
    assert (grow("device", "backward"), grow("cpu", "backward")) == (3000, 2000 + 1000)
    assert (grow("device", "step"), grow("cpu", "step")) == (0, 2000 + 1000)


def test_a_step_behind_the_forward_is_counted_beside_its_activations_and_gathers(tmp_path):
    """``step_in_forward``: the step's windows are alive while the next forward saves its
    activations and gathers its units, so the step phase also holds those (on the compute
    device), and nothing else changes."""
    data = case(3, optim="nvme", param="nvme", nvme=str(tmp_path))
    behind = estimate(Config.model_validate(data), 2, device="cuda")  # the default: on
    data["zero_optimization"]["offload_optimizer"]["step_in_forward"] = False
    base = estimate(Config.model_validate(data), 2, device="cuda")
    of = lambda est, phase, what: sum(t.bytes for t in est.transients
                                      if t.phase == phase and what in t.what)
    forward = of(base, "backward", "activations") + of(base, "backward", "gathered params")
    assert forward > 0
    assert behind.phase_total("step", "device") - base.phase_total("step", "device") == forward
    assert behind.phase_total("backward", "device") == base.phase_total("backward", "device")
    assert behind.phase_total("step", "cpu") == base.phase_total("step", "cpu")
