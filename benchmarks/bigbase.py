"""The ``bigbase`` series (issue 40, outside CI): LoRA on a big MoE whose frozen base is read
where it lies, at W = 2, ep 2, ZeRO stage 3, params on NVMe, the optimizer on the host.

``python -m benchmarks.bigbase [--quick] [--work DIR] [--out BENCHMARKS.md]``. It writes a random
Qwen3-MoE-shaped base as a bf16 Hugging Face folder (``benchmarks.bigbase_model``: tensor by
tensor, never in memory), ``moezero import-hf`` keeps it bf16, ``prepare-data --format chat``
makes the data, then in fresh ``torchrun`` processes (``benchmarks.bigbase_rank``): LoRA r 16 on
attention and experts, ``steps`` steps, a save and a resume; beside it the compute time of the
same step with the weights in memory, measured on ``compute_layers`` layers (random init, no
base) and scaled by depth. ``dd`` measures the disk before and after; a step's disk time is
its bytes read over the ``dd`` read rate. The peer row (TRL ``SFTTrainer`` + PEFT + DeepSpeed
ZeRO-3, ``offload_param`` on NVMe) is not run by this skeleton yet.

``full`` is the issue's 16 B model (Qwen3-30B-A3B's widths, 128 experts top-8, 24 layers): it
needs about 40 GB of disk and hours here; ``--quick`` is a tiny one that runs in minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from benchmarks.finetune import _cli, launch
from benchmarks.fmt import write_section
from benchmarks.machine import dd_bandwidth, machine_info
from moezero.examples import tiny_hf

SIZES = {
    "full": {"model": {"dim": 2048, "ffn_dim": 768, "n_layers": 24, "n_heads": 32,
                       "n_kv_heads": 4, "head_dim": 128, "num_experts": 128, "top_k": 8},
             "vocab": 151936, "seq_len": 1024, "steps": 3, "compute_layers": 2, "dd_mib": 1024},
    "quick": {"model": {"dim": 64, "ffn_dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                        "head_dim": 16, "num_experts": 8, "top_k": 2},
              "vocab": 512, "seq_len": 128, "steps": 3, "compute_layers": 1, "dd_mib": 64},
}
LORA = ["peft.method=lora", "peft.r=16", "peft.alpha=32.0", "peft.targets=[attn, experts]"]


def prepare(work: Path, size: dict) -> dict:
    """The bf16 HF folder, its bf16 import, the chat data; paths and sizes."""
    root = work / "bigbase"
    shutil.rmtree(root, ignore_errors=True)
    hf, chats = root / "hf", root / "chats.jsonl"
    tokens = tiny_hf.save_tokenizer(hf, 512)
    from benchmarks.bigbase_model import write_model

    vocab = max(tokens, size["vocab"])
    params = write_model(hf, size["model"], vocab)
    tiny_hf.write_jsonl(tiny_hf.conversations(200, 0, size["seq_len"] // 4), chats)
    _cli("import-hf", str(hf), "--out", str(root / "base"))
    _cli("prepare-data", str(chats), "--tokenizer", str(root / "base"), "--format", "chat",
         "--out", str(root / "data"))
    return {"root": str(root), "params": params, "vocab": vocab, "hf_bytes": _bytes(hf),
            "base_bytes": _bytes(root / "base")}


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def overrides(inputs: dict, size: dict, *, in_memory: bool) -> list[str]:
    """The ``--set`` items of a row: the base and data (or, for the compute row, no base and
    ``compute_layers`` layers), LoRA, stage 3, params on NVMe or in memory, fp32 compute."""
    root, swap = inputs["root"], Path(inputs["root"]) / "swap"
    swap.mkdir(exist_ok=True)
    param = ["zero_optimization.offload_param.device=none"] if in_memory else [
        "zero_optimization.offload_param.device=nvme",
        f"zero_optimization.offload_param.nvme_path={swap}"]
    base = [f"model.n_layers={size['compute_layers']}", "checkpoint.load=null",
            f"model.vocab_size={inputs['vocab']}", "model.qk_norm=head",
            *(f"model.{k}={v}" for k, v in size["model"].items() if k not in (
                "n_layers", "num_experts", "top_k"))] if in_memory else \
        [f"checkpoint.load={root}/base"]
    return [*base, f"data.path={root}/data", "data.val_fraction=0", "train.eval_every=0",
            f"train.seq_len={size['seq_len']}", "train.micro_batch_size=1",
            f"train.steps={size['steps'] + 1}", "moe.ep_size=2",
            f"moe.num_experts={size['model']['num_experts']}",
            f"moe.top_k={size['model']['top_k']}", "precision.dtype=fp32",
            "zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu",
            *param, *LORA]


def measure(args, work: Path, size: dict) -> dict:
    inputs = prepare(work, size)
    disk = [dd_bandwidth(inputs["root"], size["dd_mib"])]
    runs = {}
    for name, in_memory in (("in place", False), ("compute", True)):
        spec = {"steps": size["steps"], "save": not in_memory,
                "overrides": overrides(inputs, size, in_memory=in_memory)}
        runs[name] = launch(sys.executable, "benchmarks.bigbase_rank", spec, f"bigbase-{name}",
                            work, args.timeout)
        print(f"{name}: {runs[name].get('status')} {runs[name].get('error', '')}", flush=True)
    disk.append(dd_bandwidth(inputs["root"], size["dd_mib"]))
    return {"inputs": inputs, "size": size, "disk": disk, "runs": runs}


def table(results: dict) -> list[str]:
    """The series' rows: per step of rank 0, bytes read, their disk time, the scaled compute
    time, the step time; then each rank's peak RSS and anonymous memory."""
    res, size = results["bigbase"], results["bigbase"]["size"]
    read_rate = min(d.get("read", 0) for d in res["disk"]) or float("nan")
    compute = res["runs"]["compute"]
    scale = size["model"]["n_layers"] / size["compute_layers"]
    compute_s = [s["step_s"] * scale for s in compute["ranks"][0]["steps"][1:]] \
        if compute.get("status") == "ok" else []
    lines = ["## bigbase", "", f"`{results['command']}`", "",
             f"base: {res['inputs']['params']:,} params, HF folder {res['inputs']['hf_bytes']:,} B, "
             f"import {res['inputs']['base_bytes']:,} B; dd read {read_rate / 2**20:.0f} MiB/s", "",
             "| step | bytes read (rank 0) | disk time | compute (scaled) | step time |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    run = res["runs"]["in place"]
    if run.get("status") != "ok":
        return [*lines, f"| failed: {run.get('error')} | | | | |"]
    for i, s in enumerate(run["ranks"][0]["steps"]):
        c = f"{compute_s[min(i, len(compute_s) - 1)]:.2f} s" if compute_s else "-"
        lines.append(f"| {i + 1} | {s['read_bytes']:,} | {s['read_bytes'] / read_rate:.2f} s | "
                     f"{c} | {s['step_s']:.2f} s |")
    lines += ["", "| rank | peak RSS | peak anon | checkpoint |", "| ---: | ---: | ---: | ---: |"]
    for r, rank in enumerate(run["ranks"]):
        lines.append(f"| {r} | {rank['peak_rss'] / 2**20:.0f} MiB | "
                     f"{rank['anon_peak'] / 2**20:.0f} MiB | {rank.get('checkpoint_bytes', 0):,} B |")
    return [*lines, "", "Peer (TRL SFTTrainer + PEFT + DeepSpeed ZeRO-3, offload_param nvme): "
            "not run by this skeleton.", ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bigbase",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny base (minutes)")
    p.add_argument("--work", default="/tmp/moezero-bigbase", help="work directory")
    p.add_argument("--out", default=None, help="also splice the section into this report")
    p.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds per row")
    args = p.parse_args(argv)
    start, work = time.perf_counter(), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine_info(), "command": "python -m benchmarks.bigbase "
               + " ".join(argv if argv is not None else sys.argv[1:]),
               "bigbase": measure(args, work, SIZES["quick" if args.quick else "full"])}
    (work / "results-bigbase.json").write_text(json.dumps(results, indent=1))
    section = table(results)
    if args.out:
        return write_section(Path(args.out), section, "bigbase", start)
    print("\n".join(section))
    return 0


if __name__ == "__main__":
    sys.exit(main())
