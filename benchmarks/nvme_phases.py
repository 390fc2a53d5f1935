"""The ``nvme`` series (issue 28 item 3): a stage-3 nvme/nvme step, phase by phase.

``python -m benchmarks.run --series nvme [--quick]``

The ``scale`` series' model and options (``benchmarks.specs``) at a size a shared machine can
run (``mid``: 4 of the full model's 20 layers; ``--quick``: the quick size), with each
configuration of ``NVME_VARIANTS`` run in turn in fresh ``torchrun`` processes (no checkpoint),
``dd`` of the swap folder before and after. Each rank reports its steps' ``phases``
(``moezero.phases``: seconds, swap bytes issued and seconds waited per tier and phase), so the
table says which phase keeps the step above the disk time of its bytes. Bytes per parameter
count both ranks' swap bytes of one step over the model's parameters.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from statistics import median

from benchmarks.fmt import harness_command, table, write_section
from benchmarks.launch import command_line, run_one
from benchmarks.machine import dd_bandwidth, machine_info
from benchmarks.specs import NVME_VARIANTS, SCALE_SIZES, scale_spec
from benchmarks.stats import param_count

HEADING = "## NVMe stage 3 at the disk floor, phase by phase (issue 28)"
GB = 1e9
PHASES = ("forward", "backward", "reduce", "step")


def run_nvme(args, work: Path) -> dict:
    """dd, each variant once (``--repeats`` rounds, alternating), dd again."""
    mode = getattr(args, "nvme_size", None) or ("quick" if args.quick else "mid")
    variants = {k: v for k, v in NVME_VARIANTS.items() if not args.only or any(
        text == k or (text in k and text not in NVME_VARIANTS) for text in args.only)}
    swap = work / "scale-nvme"
    swap.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine_info(), "command": command_line(), "mode": mode,
               "size": SCALE_SIZES[mode], "dd_before": dd_bandwidth(swap, SCALE_SIZES[mode]["dd_mib"]),
               "runs": {}, "variants": variants, "repeats": args.repeats or 1}
    for _ in range(args.repeats or 1):
        for name, extra in variants.items():
            spec = {**scale_spec(mode), "checkpoint": False}
            spec["options"].update(extra)
            results["runs"].setdefault(name, []).append(run_one(spec, "nvme-" + name.replace(" ", "-"), args, work))
            shutil.rmtree(swap, ignore_errors=True)
            swap.mkdir(parents=True, exist_ok=True)
    results["dd_after"] = dd_bandwidth(swap, SCALE_SIZES[mode]["dd_mib"])
    shutil.rmtree(swap, ignore_errors=True)
    return results


def _dd(results: dict) -> dict | None:
    pair = [results.get("dd_before", {}), results.get("dd_after", {})]
    if any("error" in d or not d for d in pair):
        return None
    return {k: sum(d[k] for d in pair) / 2 for k in ("read", "write")}


def figures(runs: list[dict], dd: dict | None, params: int) -> dict | None:
    """Medians over every step of every run: the slower rank's times, both ranks' bytes."""
    steps = [list(zip(*(r["steps"] for r in run["ranks"]), strict=True))
             for run in runs if run.get("status") == "ok"]
    steps = [s for run in steps for s in run]  # each: one step, a record per rank
    if not steps:
        return None
    both = lambda key: median(sum(r[key] for r in s) for s in steps)
    out = {"step_s": median(max(r["s"] for r in s) for s in steps), "swap": both("swap"),
           "read": both("read"), "write": both("write"),
           "peak_rss": max(r["peak_rss"] for run in runs if run.get("status") == "ok"
                           for r in run["ranks"]), "steps": len(steps)}
    out["per_param"] = out["swap"] / params
    out["phases"] = {p: phase_figures(steps, p) for p in PHASES}
    if dd is not None:
        out["disk_s"] = out["read"] / dd["read"] + out["write"] / dd["write"]
        out["ratio"] = out["step_s"] / out["disk_s"]
    return out


def phase_figures(steps: list, name: str) -> dict:
    """One phase: the slower rank's seconds and main-thread waits; both ranks' bytes."""
    rows = [[r["phases"][name] for r in s] for s in steps]
    worst = lambda key: median(max(r.get(key, 0) for r in s) for s in rows)
    both = lambda key: median(sum(r.get(key, 0) for r in s) for s in rows)
    return {"s": worst("s"), "param_wait_s": worst("param_wait_s"),
            "optim_wait_s": worst("optim_wait_s"), "grad_wait_s": worst("grad_wait_s"),
            **{f"{t}_{op}": both(f"{t}_{op}") for t in ("param", "grad", "optim")
               for op in ("read", "write")}}


def _variant_rows(found: dict) -> list[list]:
    rows, first = [], next(iter(found.values()), None)
    for name, f in found.items():
        if f is None:
            rows.append([name, "failed"] + ["–"] * 7)
            continue
        ratio = "–" if "ratio" not in f else f"{f['ratio']:.2f}×"
        disk = "–" if "disk_s" not in f else f"{f['disk_s']:.1f} s"
        vs = "–" if first is None else f"{f['step_s'] / first['step_s']:.2f}×"
        rows.append([name, f"{f['step_s']:.1f} s", vs, disk, ratio, f"{f['swap'] / GB:.2f} GB",
                     f"{f['per_param']:.1f} B", f"{f['peak_rss'] / 2**30:.2f} GiB", str(f["steps"])])
    return rows


def phase_rows(found: dict) -> list[list]:
    rows = []
    for name, f in found.items():
        for p, ph in (f or {}).get("phases", {}).items():
            # the main thread's: optimizer and gradient waits outside the step are a helper
            # thread's (backward's gradient writes; the step behind the forward)
            waits = ph["param_wait_s"] + (ph["optim_wait_s"] + ph["grad_wait_s"] if p == "step" else 0)
            rows.append([name, p, f"{ph['s']:.2f}", f"{waits:.2f}", f"{max(ph['s'] - waits, 0):.2f}",
                         f"{ph['param_read'] / GB:.2f}", f"{ph['grad_write'] / GB:.2f}",
                         f"{ph['grad_read'] / GB:.2f}",
                         f"{ph['optim_read'] / GB:.2f} / {ph['optim_write'] / GB:.2f}"])
    return rows


def nvme_section(results: dict) -> list[str]:
    m = results["size"]["model"]
    params, dd = param_count(m), _dd(results)
    found = {name: figures(runs, dd, params) for name, runs in results["runs"].items()}
    machine = results["machine"]
    dd_line = "dd failed" if dd is None else (
        f"dd (direct I/O, in the swap folder, mean of before and after): read "
        f"{dd['read'] / 1e6:,.0f} MB/s, write {dd['write'] / 1e6:,.0f} MB/s")
    variants = "; ".join(f"`{k}`: " + (", ".join(f"`{o}: {v}`" for o, v in opts.items()) or
                                        "the scale series' options")
                         for k, opts in results.get("variants", NVME_VARIANTS).items())
    return [HEADING, "",
            f"The scale series' model at {m['n_layers']} layer(s) ({params / 1e9:.2f} B parameters, "
            f"W = 2, ep 2, fp32, stage 3, params and optimizer on NVMe, one swap folder), no "
            f"checkpoint. Measured {machine['date']} on {machine['cpu']}, torch "
            f"{machine['torch']}; {dd_line}. Configurations: {variants}.", "",
            *table(["configuration", "step", "vs the first", "disk time of its bytes", "step / disk",
                    "swap bytes per step (both ranks)", "per parameter", "peak RSS / rank",
                    "steps"], _variant_rows(found)), "",
            *phase_table(found),
            "Command (this table only): `" + _command(results) + "`"]


def _command(results: dict) -> str:
    only = tuple(results["variants"]) if len(results.get("variants", NVME_VARIANTS)) < len(
        NVME_VARIANTS) else ()
    return (harness_command(results, "nvme", only)
            + (" --nvme-size full" if results.get("mode") == "full" else "")
            + (f" --repeats {results['repeats']}" if results.get("repeats", 1) > 1 else ""))


def phase_table(found: dict) -> list[str]:
    """The per-phase table of each configuration's figures (``figures``)."""
    return ["Per phase (median step; seconds of the slower rank; waits: its main thread "
            "blocked on swap reads/writes; compute = phase − waits; GB issued by both ranks):",
            "", *table(["configuration", "phase", "s", "waits s", "compute s", "param read GB",
                        "grad write GB", "grad read GB", "master+moments read / write GB"],
                       phase_rows(found)), ""]


def run_only(args, out: Path, work: Path) -> int:
    """``--series nvme`` alone: measure (or read ``--from-json``), rewrite only its section."""
    start = time.perf_counter()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        results = run_nvme(args, work)
        (work / "results-nvme.json").write_text(json.dumps(results, indent=1))
    return write_section(out, nvme_section(results), "nvme", start)
