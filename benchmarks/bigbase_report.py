"""The ``bigbase`` series' section of BENCHMARKS.md, from its results (``benchmarks.bigbase``):
the machine, the inputs, per step of the in-place row the bytes read, their disk time (both
ranks' bytes over the slower ``dd`` read rate: the two ranks share the disk), the compute time
of the same step with the weights in memory (scaled by depth), the step time; each rank's peak
RSS and anonymous memory; the disk used; the issue's three targets, each met or not; the peer.
"""

from __future__ import annotations

GIB = 2**30
TITLE = "## bigbase: LoRA on a 16 B MoE, the frozen base read where it lies (issue 40)"


def _mib(x: float) -> str:
    return f"{x / 2**20:,.0f} MiB"


def _steps(res: dict) -> list[tuple[str, list[dict]]]:
    """(label, every rank's record of that step) of the timed steps, then the resumed one."""
    ranks = res["runs"]["in place"]["ranks"]
    rows = [(str(i + 1), [r["steps"][i] for r in ranks]) for i in range(len(ranks[0]["steps"]))]
    resumed = res["runs"].get("resume", {})
    if resumed.get("status") == "ok":
        rows.append(("resumed", [r["steps"][0] for r in resumed["ranks"]]))
    return rows


def _compute(res: dict) -> list[float]:
    """The compute row's step times (the slower rank), scaled to the full depth; [] if failed."""
    run, size = res["runs"].get("compute", {}), res["size"]
    if run.get("status") != "ok":
        return []
    scale = size["model"]["n_layers"] / size["compute_layers"]
    per = zip(*(r["steps"] for r in run["ranks"]), strict=True)
    return [max(s["step_s"] for s in step) * scale for step in per]


def step_table(res: dict, read_rate: float) -> tuple[list[str], list[float]]:
    """The per-step rows and each step's ratio step / max(disk, compute)."""
    compute = _compute(res)
    steady = min(compute[1:] or compute) if compute else float("nan")
    lines = ["| step | bytes read (rank 0 / rank 1) | disk time | compute (scaled) | step time "
             "| step / max |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    ratios = []
    for label, ranks in _steps(res):
        read = [r["read_bytes"] for r in ranks]
        disk, step = sum(read) / read_rate, max(r["step_s"] for r in ranks)
        ratios.append(step / max(disk, steady))
        lines.append(f"| {label} | {read[0] / GIB:.2f} / {read[1] / GIB:.2f} GiB | {disk:.0f} s | "
                     f"{steady:.0f} s | {step:.0f} s | {ratios[-1]:.2f} |")
    return lines, ratios


def _measured(res: dict) -> list[tuple[str, dict]]:
    """(row, run) of the moezero rows that finished: the steps, then the resume."""
    return [(name, res["runs"][name]) for name in ("in place", "resume")
            if res["runs"].get(name, {}).get("status") == "ok"]


def rank_table(res: dict) -> list[str]:
    lines = ["| row | rank | peak RSS | peak anon | checkpoint (adapters) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, run in _measured(res):
        for r, rank in enumerate(run["ranks"]):
            lines.append(f"| {name} | {r} | {_mib(rank['peak_rss'])} | "
                         f"{_mib(rank['anon_peak'])} | "
                         f"{rank.get('checkpoint_bytes', 0) / 2**20:,.1f} MiB |")
    return lines


def disk_lines(res: dict) -> tuple[list[str], bool]:
    """The disk used by the run: the import plus the peak of its swap and checkpoint folders
    (the adapters, their state, the checkpoint), against 1.1 × the bf16 HF folder plus that."""
    inputs, watch = res["inputs"], res["runs"]["in place"].get("watch", {})
    extra = watch.get("peak_tree", 0)
    used, bound = inputs["base_bytes"] + extra, 1.1 * inputs["hf_bytes"] + extra
    return [f"Disk used by the run: the import {inputs['base_bytes'] / GIB:.2f} GiB "
            f"({inputs['base_bytes'] / inputs['hf_bytes']:.3f}x the bf16 HF folder's "
            f"{inputs['hf_bytes'] / GIB:.2f} GiB) + swap and checkpoints at their peak "
            f"{extra / GIB:.3f} GiB = {used / GIB:.2f} GiB (a swap copy of the frozen base "
            f"would add about {inputs['base_bytes'] / GIB:.0f} GiB)."], \
        used <= bound


def peer_lines(res: dict) -> list[str]:
    run = res["runs"].get("peer")
    if run is None:
        return ["Peer: not run (`--peer-python ''`)."]
    head = "Peer (TRL SFTTrainer + PEFT LoRA + DeepSpeed ZeRO-3, `offload_param` nvme, " \
           "`offload_optimizer` cpu, bf16, same HF folder and chats, W = 2): "
    if run.get("status") == "ok":
        ranks = run["ranks"]
        steps = ", ".join(f"{max(s):.0f} s" for s in zip(*(r["step_s"] for r in ranks),
                                                         strict=True))
        rss = ", ".join(_mib(r["peak_rss"]) for r in ranks)
        return [f"{head}steps {steps}; peak RSS {rss}; "
                f"peak swap {run['watch']['peak_tree'] / GIB:.2f} GiB."]
    at = run.get("watch", {}).get("at_stop") or {}
    where = ""
    if at:
        rss = ", ".join(_mib(s.get("VmRSS", 0)) for s in at.get("ranks", {}).values())
        where = (f" At that moment: RSS per process {rss}; memory available "
                 f"{at['mem_available'] / GIB:.1f} GiB; free disk {at['free_disk'] / GIB:.1f} "
                 f"GiB; its swap {at['tree'] / GIB:.2f} GiB.")
    peak = ", ".join(_mib(v) for v in run.get("watch", {}).get("peak_rss", {}).values())
    return [f"{head}**failed** after {run.get('wall_s', 0):.0f} s: `{run.get('error')}` "
            f"(last error line of its log: `{run.get('log_tail')}`).{where} "
            f"Peak RSS per process: {peak}."]


def table(results: dict) -> list[str]:
    res = results["bigbase"]
    disk = [d for d in res["disk"] if "read" in d]
    read_rate = min(d["read"] for d in disk) if disk else float("nan")
    inputs, size = res["inputs"], res["size"]
    lines = [TITLE, "", f"`{results['command']}`", "",
             f"Base: {inputs['params']:,} params ({size['model']['n_layers']} layers, "
             f"{size['model']['num_experts']} experts top-{size['model']['top_k']}), bf16 HF "
             f"folder {inputs['hf_bytes'] / GIB:.2f} GiB written in {inputs['write_s']:.0f} s, "
             f"imported in {inputs['import_s']:.0f} s; compute {size.get('dtype', 'fp32')}, seq "
             f"{size['seq_len']}. dd (direct I/O, {size['dd_mib']} MiB) before / after: read "
             + " / ".join(_mib(d["read"]) + "/s" for d in disk) + ", write "
             + " / ".join(_mib(d["write"]) + "/s" for d in disk) + ". Load: "
             + " → ".join(u.split("load average:")[-1].split(",")[0].strip()
                          for u in res.get("uptime", [])) + ".", ""]
    run = res["runs"]["in place"]
    if run.get("status") != "ok":
        return [*lines, f"In-place row **failed**: `{run.get('error')}`", "",
                *peer_lines(res), ""]
    steps, ratios = step_table(res, read_rate)
    disk_text, disk_ok = disk_lines(res)
    rss = max(r["peak_rss"] for _, measured in _measured(res) for r in measured["ranks"])
    return [*lines, *steps, "", *rank_table(res), "", *disk_text, "",
            f"Targets: peak RSS ≤ 3 GiB per rank: {'met' if rss <= 3 * GIB else 'not met'} "
            f"({rss / GIB:.2f} GiB); disk ≤ 1.1x the bf16 base + adapters: "
            f"{'met' if disk_ok else 'not met'}; step ≤ 1.2x max(disk, compute): "
            f"{'met' if max(ratios) <= 1.2 else 'not met'} (worst {max(ratios):.2f}x).", "",
            *peer_lines(res), ""]
