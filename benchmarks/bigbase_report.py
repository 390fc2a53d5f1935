"""The ``bigbase`` series' section of BENCHMARKS.md, from its results (``benchmarks.bigbase``)."""

from __future__ import annotations


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
