"""GPU benchmark (issue 19): a ~1B-parameter bf16 MoE at W = 1, moezero beside plain FSDP2.

``python -m benchmarks.gpu [--out BENCHMARKS.md] [--only TEXT] [--peak-tflops X]``
``python -m benchmarks.gpu --smoke``: a tiny fp32 model on CPU (gloo) through every row, to
check the code without a GPU; prints the section and writes nothing.
``python -m benchmarks.gpu --check``: the first session on a lent GPU, in one command
(``benchmarks.gpu_check``); with ``--smoke`` it runs the same steps on CPU.

Each row trains in a fresh process (``benchmarks.gpu_worker``) on one GPU: moezero at ZeRO-2
(no offload; with the grouped experts, with the per-expert loop, with ``train.deterministic``),
moezero at ZeRO-3 with optimizer state and params offloaded to CPU and to NVMe, and FSDP2
(``fully_shard`` per block, bf16 params, fp32 reduction, fused AdamW) on the same ``Decoder``,
whose experts run on torch's grouped GEMM. Figures: tokens/s (median step), MFU and CUDA peak
allocated memory. The section, headed with the device name, replaces its own section of
``--out`` (``benchmarks.fmt.splice``); nothing else in the file changes. Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.fmt import mib, splice, table
from benchmarks.gpu_check import check
from benchmarks.gpu_rows import MODEL, REPO, ROWS, SMOKE_MODEL, SMOKE_TRAIN, TRAIN, run_row
from benchmarks.stats import param_count

SECTION = "## GPU: ~1B-parameter bf16 MoE at W = 1 (issue 19)"

PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                    ("H20", 148.0), ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0))
"""Dense bf16 peak (no sparsity) by device-name substring, first match wins."""


def active_params(m: dict) -> int:
    """Parameters a token's FLOPs use: lm_head, attention, router and its top-k experts
    (the embedding is a lookup; norms are negligible)."""
    per_layer = 4 * m["dim"] ** 2 + m["num_experts"] * m["dim"] + m["top_k"] * 3 * m["dim"] * m["ffn_dim"]
    return m["vocab_size"] * m["dim"] + m["n_layers"] * per_layer


def flops_per_token(m: dict, seq_len: int) -> float:
    """Training FLOPs per token: 6 x active params + causal attention (6 L S D)."""
    return 6 * active_params(m) + 6 * m["n_layers"] * seq_len * m["dim"]


def peak_flops(device_name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    return next((t * 1e12 for key, t in PEAK_BF16_TFLOPS if key in device_name), None)


def section(results: dict) -> list[str]:
    """The BENCHMARKS.md section: device, setup, one row per configuration."""
    m, t, peak = results["model"], results["train"], results["peak_flops"]
    fpt = flops_per_token(m, t["seq_len"])
    rows = []
    for r in results["rows"]:
        if r["status"] != "ok":
            rows.append([r["name"], f"failed: {r['error']}", "–", "–", "–", "–", "–"])
            continue
        mfu = f"{100 * fpt * r['tokens_per_s'] / peak:.1f}%" if peak else "n/a (unknown peak)"
        rows.append([r["name"], "ok", f"{r['tokens_per_s']:,.0f}", mfu, mib(r["cuda_peak_bytes"]),
                     mib(r["host_peak_rss"]), f"{r['losses'][0]:.2f} → {r['losses'][-1]:.2f}"])
    return [SECTION, "",
            f"Device: **{results['device']}**; torch {results['torch']}; {results['date']}. "
            f"Model: {param_count(m):,} parameters ({active_params(m):,} active per token), "
            f"dim {m['dim']}, {m['n_layers']} layers, {m['num_experts']} SwiGLU experts of width "
            f"{m['ffn_dim']}, top-{m['top_k']}, vocab {m['vocab_size']}; {results['dtype']}; "
            f"micro-batch {t['micro_batch_size']} × {t['seq_len']} tokens; {t['warmup']} warm-up "
            f"+ {t['timed']} timed steps, each row in a fresh process. Command: "
            f"`{results['command']}`.", "",
            *table(["configuration", "status", "tokens/s", "MFU", "CUDA peak allocated",
                    "host peak RSS", "loss first → last"], rows), "",
            f"- MFU: {fpt / 1e9:.2f} GFLOP per token (6 × active parameters + causal attention "
            f"6·L·S·D) × tokens/s over the device's dense bf16 peak "
            f"({peak / 1e12:.0f} TFLOP/s)." if peak else "- MFU: peak unknown for this device "
            "(pass --peak-tflops).",
            "- FSDP2 runs the same `Decoder` (experts on `torch.nn.functional.grouped_mm`, "
            "weights stacked by copy since FSDP2 owns their storage) with torch's fused AdamW."]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="BENCHMARKS.md", help="report whose GPU section is replaced")
    p.add_argument("--work-dir", default=str(REPO / "bench_out" / "gpu"), help="specs, logs, NVMe swap")
    p.add_argument("--only", action="append", default=[], metavar="TEXT", help="rows whose name contains TEXT")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per row")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak, when the device is not in the table")
    p.add_argument("--smoke", action="store_true", help="tiny fp32 model on CPU; print, write nothing")
    p.add_argument("--check", action="store_true",
                   help="a lent GPU's first session in one command (benchmarks.gpu_check): the "
                        "default recipe with NCCL at W = 1, the gpu-marked tests, then every row "
                        "at a reduced size; one table, under 10 minutes on one H100")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.check:
        return check(args)
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA GPU here (use --smoke to check the code on CPU)")
        return 2
    work = Path(args.work_dir)
    rows = [r for r in ROWS if not args.only or any(t in r[0] for t in args.only)]
    device = "CPU (smoke run)" if args.smoke else torch.cuda.get_device_name(0)
    results = {"device": device, "torch": torch.__version__, "model": SMOKE_MODEL if args.smoke else MODEL,
               "train": SMOKE_TRAIN if args.smoke else TRAIN, "dtype": "fp32" if args.smoke else "bf16",
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": "python -m benchmarks.gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
               "peak_flops": None if args.smoke else peak_flops(device, args.peak_tflops), "rows": []}
    for name, system, options, grouped in rows:
        results["rows"].append(run_row(name, system, options, grouped, args, work))
        print(results["rows"][-1], flush=True)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    text = "\n".join(section(results))
    if not args.smoke:
        out = Path(args.out)
        out.write_text(splice(out.read_text() if out.exists() else "# Benchmarks\n", section(results)))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
