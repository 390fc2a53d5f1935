"""``moezero estimate`` counts a frozen base by its dtype and tier (docs/finetune.md, "A big
base on one GPU"): the base's weights in the compute dtype on the tier of the ZeRO stage and
``offload_param``, and the base checkpoint on disk in its own dtype (a bf16 import: 2 B per
parameter). Worked out by hand from the small model's shapes
(tests/torch_impl/test_estimate_finetune.py: ``BASE`` frozen params, attention adapters).
"""

from __future__ import annotations

import torch

from moezero.cli import main
from moezero.config import Config
from moezero.estimate import estimate, format_table
from tests.support.hf import save_hf
from tests.torch_impl.test_estimate_finetune import ATTN_ADAPTERS, BASE, lora
from tests.torch_impl.test_hf_families import hf_model


def test_the_base_is_counted_in_the_compute_dtype_on_its_tier():
    """Stage 3 bf16 on a GPU at W = 1: base on the host (offload_param cpu) 2 B each; stage 2
    fp32 on the CPU: the base in the flat params, 4 B each, on the host."""
    host = estimate(Config.model_validate(lora(3, dtype="bf16", param="cpu", optim="cpu")), 1,
                    base_dtype="bf16")
    assert host.frozen_numel == BASE and host.trained_numel == ATTN_ADAPTERS
    assert host.frozen == (("cpu", 2 * BASE),)
    assert host.get("params", "device") == 0 and host.get("params", "cpu") == 2 * (BASE + ATTN_ADAPTERS)
    assert host.base_disk_bytes() == 2 * BASE
    cpu = estimate(Config.model_validate(lora(2)), 1, device="cpu", base_dtype="fp32")
    assert cpu.frozen == (("cpu", 4 * BASE),) and cpu.base_disk_bytes() == 4 * BASE
    on_gpu = estimate(Config.model_validate(lora(3, dtype="bf16", optim="cpu")), 1)
    assert on_gpu.frozen == (("device", 2 * BASE),) and on_gpu.base_disk_bytes() == 2 * BASE


def test_the_table_says_the_frozen_base_and_its_checkpoint():
    est = estimate(Config.model_validate(lora(3, dtype="bf16", param="cpu", optim="cpu")), 1,
                   base_dtype="bf16")
    gib = lambda b: f"{b / 2**30:.3f}"
    line = next(x for x in format_table(est).splitlines() if x.startswith("frozen base:"))
    assert line == (f"frozen base: {BASE:,} params; this rank holds {gib(2 * BASE)} GiB on cpu "
                    f"(bf16); the base checkpoint {gib(2 * BASE)} GiB on disk (bf16)")
    full = estimate(Config.model_validate(lora(2) | {"peft": {"method": "none"}}), 1,
                    device="cpu")
    assert full.frozen_numel == 0 and "frozen base" not in format_table(full)


def test_the_cli_reads_the_bases_dtype_from_checkpoint_load(tmp_path, capsys):
    src = save_hf(hf_model("qwen3_moe").to(torch.bfloat16), tmp_path / "hf")
    assert main(["import-hf", str(src), "--out", str(tmp_path / "base")]) == 0
    capsys.readouterr()
    assert main(["estimate", "--nproc", "1", "--device", "cpu", "--set", "moe.ep_size=1",
                 "--set", f"checkpoint.load={tmp_path / 'base'}", "--set", "peft.method=lora",
                 "--set", "peft.targets=[attn]"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("frozen base:"))
    assert line.endswith("on disk (bf16)"), line


def test_a_base_read_in_place_costs_no_swap_file(tmp_path):
    """Stage 3 fp32 on the CPU, params on NVMe: a LoRA run from a bf16 base reads the base's
    files (2 B x BASE, by hand) and writes swap files for the adapters only; without a known
    base the frozen shards are copied to swap files in the compute dtype (4 B each)."""
    cfg = Config.model_validate(lora(3, param="nvme", optim="cpu", nvme=str(tmp_path)))
    copied = estimate(cfg, 1, device="cpu")
    in_place = estimate(cfg, 1, device="cpu", base_dtype="bf16")
    assert in_place.in_place and not copied.in_place
    assert in_place.frozen == (("nvme", 2 * BASE),)
    ((tier, swap),) = copied.frozen
    assert tier == "nvme" and swap >= 4 * BASE
    assert in_place.get("params", "nvme") == copied.get("params", "nvme") - swap
    line = next(x for x in format_table(in_place).splitlines() if x.startswith("frozen base:"))
    assert f"this rank reads {2 * BASE / 2**30:.3f} GiB on nvme in place from the base's files " \
           "(bf16, no swap file)" in line
