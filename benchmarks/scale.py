"""The ``scale`` series (issue 16): an MoE larger than the machine's memory, trained from swap.
This module is its harness; the spec is ``benchmarks.specs`` (``SCALE_*``, ``scale_spec``),
a rank ``benchmarks.scale_rank``, the report section ``benchmarks.tables_scale``.

``python -m benchmarks.run --series scale [--quick] [--peer-json PATH]``

One moezero run at W = 2 (gloo, fresh ``torchrun`` processes): ZeRO stage 3, params and
optimizer state (and with them the reduced gradients) in NVMe swap files, fp32, expert
parallelism ``ep_size`` so each rank steps only its own experts (no expert all-gather). Each
rank times its initialisation (the sharded build and the swap files written), ``timed``
training steps (each with the bytes its process moved to and from the disk, ``/proc/self/io``,
and through the swap engine, ``AsyncIO.stats``), one checkpoint save, a cold load of it into
the same engine and one more step (the resume). The disk's direct-I/O bandwidth is measured
with ``dd`` in the swap folder right before and right after the run (``machine.dd_bandwidth``);
a step's disk time is its bytes at those speeds (both ranks share the disk), and the report
gives the step time's ratio to it. The DeepSpeed peer row is read from ``--peer-json`` (written
by ``benchmarks/deepspeed_scale.py``); without one the row says "not run". The ranks run in
the default environment: the glibc setting the series once passed them
(``MALLOC_MMAP_THRESHOLD_=1048576``) is made by the engine itself for offloaded tiers
(``moezero.offload.malloc``), so the series measures what ``moezero train`` gets.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from benchmarks.fmt import write_section
from benchmarks.launch import command_line, run_one
from benchmarks.machine import dd_bandwidth, machine_info
from benchmarks.specs import SCALE_SIZES, scale_spec
from benchmarks.tables_scale import scale_section


def read_peer(path: str | None) -> dict:
    """The DeepSpeed peer's JSON (``benchmarks/deepspeed_scale.py``), or why there is none."""
    if not path:
        return {"ok": False, "error": "not run (no --peer-json given)"}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        return {"ok": False, "error": f"not run ({path}: {type(exc).__name__})"}


def run_scale(args, work: Path) -> dict:
    """dd, the run, dd again; the peer's JSON beside it."""
    mode = "quick" if args.quick else "full"
    swap = work / "scale-nvme"
    swap.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine_info(), "command": command_line(), "mode": mode,
               "size": SCALE_SIZES[mode], "dd_before": dd_bandwidth(swap, SCALE_SIZES[mode]["dd_mib"])}
    results["run"] = run_one(scale_spec(mode), f"scale-{mode}", args, work)
    results["dd_after"] = dd_bandwidth(swap, SCALE_SIZES[mode]["dd_mib"])
    results["peer"] = read_peer(args.peer_json)
    shutil.rmtree(swap, ignore_errors=True)
    shutil.rmtree(work / "ckpt" / f"scale-{mode}", ignore_errors=True)
    return results


def run_scale_only(args, out: Path, work: Path) -> int:
    """``--series scale`` alone: measure (or read ``--from-json``), rewrite only its section."""
    start = time.perf_counter()
    if args.from_json:  # a later --peer-json (the peer ran after) replaces the stored row
        results = json.loads(Path(args.from_json).read_text())
        if args.peer_json:
            results["peer"] = read_peer(args.peer_json)
    else:
        results = run_scale(args, work)
        (work / "results-scale.json").write_text(json.dumps(results, indent=1))
    return write_section(out, scale_section(results), "scale", start)
