"""Run moezero and its peers side by side and write ``BENCHMARKS.md``.

``python -m benchmarks.run [--quick] [--out BENCHMARKS.md] [--peer-python PATH]``

The compared configurations train the same model on the same data at W=2 (gloo), each run in
fresh processes started by ``torchrun``; they are interleaved round by round (A B C, A B C,
...) and the machine's limits (``dd``, memory copy) are measured at the start of every round.
Then the other series (``benchmarks.specs``: experts sweep, tiled step, memory vs W, large
checkpoints) run once each, and the NVMe swap throughput (``benchmarks.swap``) is measured
once when that module exists.
moezero and FSDP2 run with this interpreter; DeepSpeed with ``--peer-python`` (its own venv,
``DS_ACCELERATOR=cpu``). A configuration that is rejected or fails is reported with its error
line and not retried; the other rows still run. Raw results go to ``<work-dir>/results.json``;
``--from-json`` renders a report from such a file without running anything.
After a run of the main series the new report is checked against the one it replaces
(``benchmarks.check``): exit status 1 when a peer row failed or a peak-anon ratio worsened.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import check, finetune, grouped, hoststep, nvme_phases, report, tables_data
from benchmarks.data_prep import data_prep
from benchmarks.fmt import write_section
from benchmarks.launch import REPO, command_line, error_line, run_one
from benchmarks.machine import dd_bandwidth, machine_info, memcpy_bandwidth, swap_bandwidth
from benchmarks.scale import run_scale_only
from benchmarks.specs import SIZES, extra_specs, main_specs
from benchmarks.stats import run_stats

_PEER_PROBE = """
import json, time, torch
start = time.perf_counter()
import deepspeed
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None:
    builder.load()  # JIT-built once (~2 min here), then cached; keeps it out of the timed runs
print(json.dumps({"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                  "accelerator": get_accelerator().device_name(),
                  "setup_s": time.perf_counter() - start}))
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, few steps (< 10 min)")
    p.add_argument("--out", default="BENCHMARKS.md", help="report to write (default BENCHMARKS.md)")
    p.add_argument("--plots-dir", default=str(REPO / "benchmarks"), help="where PNG plots go")
    p.add_argument("--peer-python", default=os.environ.get("MOEZERO_PEER_PYTHON", sys.executable),
                   help="interpreter of the venv holding DeepSpeed (default $MOEZERO_PEER_PYTHON "
                        "or this one)")
    p.add_argument("--peer-note", default="", help="a line about the peer install (e.g. its error)")
    p.add_argument("--work-dir", default=str(REPO / "bench_out"),
                   help="scratch: specs, logs, checkpoints, dd files, results.json")
    p.add_argument("--repeats", type=int, help="rounds of the main configurations")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    p.add_argument("--only", action="append", default=[], metavar="TEXT",
                   help="run only configurations named TEXT, or whose name contains it "
                        "(repeatable)")
    p.add_argument("--series", action="append", default=[], metavar="NAME",
                   help="run only this series: main, sweep, tiled, state, ckpt, grouped, "
                        "data, collectives, estimate (repeatable), or one of scale, nvme, "
                        "hoststep, finetune alone; a run of series that own their sections "
                        "(grouped, data, tiled, collectives, estimate and the lone ones) "
                        "updates only those sections of --out")
    p.add_argument("--nvme-size", choices=("quick", "mid", "full"),
                   help="nvme series: the model's size (default mid, quick with --quick; full "
                        "is the scale series' 2.05 B: ~35 GB of swap, minutes per step)")
    p.add_argument("--from-json", help="render the report from this results.json; run nothing")
    p.add_argument("--peer-json", help="scale series: the DeepSpeed peer's result "
                                       "(benchmarks/deepspeed_scale.py --out); else 'not run'")
    return p


def peer_probe(python: str, note: str) -> dict:
    """DeepSpeed's and torch's versions in the peer venv, or the error line."""
    if note:
        return {"error": note}
    try:
        proc = subprocess.run([python, "-c", _PEER_PROBE], capture_output=True, text=True,
                              env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{python}: {exc}"}
    if proc.returncode:
        return {"error": error_line(proc.stdout + proc.stderr)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _progress(run: dict, index: int, total: int) -> None:
    spec = run["spec"]
    head = f"[{index}/{total}] {spec['name']} E={spec['model']['num_experts']} ({run['tag']})"
    if run["status"] == "ok":
        stats = run_stats(run)
        body = (f"{stats['tokens_per_s']:,.0f} tokens/s per rank, "
                f"peak RSS {stats['peak_rss'] / 2**20:,.0f} MiB")
    else:
        body = f"{run['status']}: {run.get('error') or run['ranks'][0].get('note')}"
    print(f"{head}: {body} [{run['wall_s']:.1f} s]", flush=True)


def _selected(specs: list[dict], args: argparse.Namespace) -> list[dict]:
    """The specs ``--only`` (name) and ``--series`` let through."""
    return [s for s in specs if (not args.only or any(t in s["name"] for t in args.only))
            and (not args.series or s["series"] in args.series)]


def _extra_tag(spec: dict) -> str:
    return (f"{spec['series']}-{_slug(spec['name'])}-e{spec['model']['num_experts']}"
            f"-w{spec['world_size']}")


def run_all(args: argparse.Namespace, size: dict, repeats: int, work: Path) -> dict:
    """Limits and main configurations round by round, then the sweeps and series run once;
    the in-process ``grouped`` series last. Disk limits, the swap figures and the DeepSpeed
    probe are measured only when a selected run needs them."""
    main, extra = _selected(main_specs(size), args), _selected(extra_specs(size), args)
    needs_peer = any(s["system"] == "deepspeed" for s in main + extra)
    results = {"machine": machine_info(), "command": command_line(),
               "peer": peer_probe(args.peer_python, args.peer_note) if needs_peer
               else {"error": "not probed: no DeepSpeed run selected"},
               "mode": "quick" if args.quick else "full",
               "size": size, "repeats": repeats, "limits": [], "runs": [],
               "swap": swap_bandwidth(work, size["swap_mib"]) if main or extra
               else {"error": "not measured in this run"}}
    rounds = [[s for s in main if rnd <= s.get("rounds", repeats)] for rnd in range(1, repeats + 1)]
    rounds = [specs for specs in rounds if specs]
    total, done, dropped = sum(map(len, rounds)) + len(extra), 0, set()
    for rnd, specs in enumerate(rounds, start=1):
        results["limits"].append({"dd": dd_bandwidth(work, size["dd_mib"]),
                                  "memcpy": memcpy_bandwidth(size["memcpy_mib"])})
        for spec in specs:
            done += 1
            if spec["name"] in dropped:
                continue
            run = run_one(spec, f"{_slug(spec['name'])}-r{rnd}", args, work)
            _progress(run, done, total)
            results["runs"].append(run)
            if run["status"] != "ok":
                dropped.add(spec["name"])  # rejected or broken: do not retry
    for spec in extra:
        done += 1
        run = run_one(spec, _extra_tag(spec), args, work)
        _progress(run, done, total)
        results["runs"].append(run)
    if not args.only and (not args.series or "grouped" in args.series):
        results["grouped"] = grouped.measure(size)
        print("\n".join(grouped.section(results)), flush=True)
    if "data" in args.series or not (args.series or args.only or args.quick):
        results["data_prep"] = data_prep(work, size["data_mb"])
    return results


def run_data_only(args: argparse.Namespace, size: dict, work: Path) -> int:
    """``--series data`` alone: measure, then rewrite only that section of the report."""
    start = time.perf_counter()
    results = {"machine": machine_info(), "command": command_line(),
               "data_prep": data_prep(work, size["data_mb"])}
    (work / "results-data.json").write_text(json.dumps(results, indent=1))
    return write_section(Path(args.out), tables_data.data_section(results), "data", start)


ALONE = ("scale", "nvme", "hoststep", "finetune")
"""Series that run on their own (their own inputs, launches and sections)."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    alone = [s for s in args.series if s in ALONE]
    if alone and len(set(args.series)) > 1:
        parser.error(f"--series {alone[0]} runs alone; run the others in another call")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.series == ["data"] and not args.from_json:
        return run_data_only(args, SIZES["quick" if args.quick else "full"], work)
    if args.series == ["scale"]:  # one run of its own (dd around it): benchmarks.scale
        return run_scale_only(args, Path(args.out), work)
    if args.series == ["nvme"]:  # its variants in turn, dd around them: benchmarks.nvme_phases
        return nvme_phases.run_only(args, Path(args.out), work)
    if args.series == ["hoststep"]:  # in this process, one thread: benchmarks.hoststep
        return hoststep.run_only(args, Path(args.out), work, SIZES["quick" if args.quick else "full"])
    if args.series == ["finetune"]:  # its own inputs and launches: benchmarks.finetune
        return finetune.run_only(args, Path(args.out), work, args.quick)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        size = SIZES["quick" if args.quick else "full"]
        repeats = args.repeats or size["repeats"]
        results = run_all(args, size, repeats, work)
        results["elapsed_s"] = time.perf_counter() - start
        (work / "results.json").write_text(json.dumps(results, indent=1))
    if report.sections_only(args.series):
        report.update_sections(results, Path(args.out), args.series)
        print(f"updated the {', '.join(args.series)} section(s) of {args.out} "
              f"({time.perf_counter() - start:.0f} s)")
        return 0
    out = Path(args.out)
    committed = out.read_text() if out.exists() else ""
    text = report.write(results, out, Path(args.plots_dir))
    print(report.console_summary(text))
    print(f"wrote {args.out} ({time.perf_counter() - start:.0f} s)")
    if args.only or (args.series and "main" not in args.series):
        return 0  # the main table was not run in full: nothing to check
    return check.report_failures(committed, text)  # benchmarks.check


if __name__ == "__main__":
    sys.exit(main())
