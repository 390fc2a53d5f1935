"""Report section about communication: collectives per training step against the number of
optimizer groups (the ``collectives`` series of ``benchmarks.specs``), from ``results.json``."""

from __future__ import annotations

from benchmarks.fmt import commands, table
from benchmarks.specs import COLLECTIVE_STAGES, GATHER_MODES, WORLD_SIZE
from benchmarks.stats import run_stats

HEADING = "## Collectives per step against optimizer groups (issue 19)"
OPS = ("reduce-scatter", "all-gather", "all-reduce", "all-to-all")


def _figures(run: dict) -> dict | None:
    """Groups per rank, the last timed step's collectives (the larger rank) and step time."""
    if run["status"] != "ok" or not run["ranks"][0].get("trace", {}).get("collectives"):
        return None
    ranks = run["ranks"]
    counts = max((r["trace"]["collectives"][-1] for r in ranks), key=lambda c: sum(c.values()))
    return {"groups": max(r["info"]["optimizer_groups"] for r in ranks), "counts": counts,
            "total": sum(counts.values()), "step_ms": run_stats(run)["step_ms"]}


def _row(run: dict) -> list:
    options, fig = run["spec"]["options"], _figures(run)
    mode = "per-group" if "zero_optimization.allgather_bucket_size" in options else "bucketed"
    head = [options["zero_optimization.stage"], mode, options["moe.max_group_size"] or "none"]
    if fig is None:
        return head + [f"{run['status']}: {run.get('error') or run['ranks'][0].get('note')}"] \
            + ["–"] * (len(OPS) + 2)
    return head + [f"{fig['groups']:,}", *(fig["counts"].get(op, 0) for op in OPS),
                   fig["total"], f"{fig['step_ms']:.0f}"]


def _order(run: dict) -> tuple:
    """Stage, then bucketed before per-group, then fewer groups (a larger cap) first."""
    options = run["spec"]["options"]
    cap = options["moe.max_group_size"]
    return (options["zero_optimization.stage"], "zero_optimization.allgather_bucket_size" in options,
            cap is not None, -(cap or 0))


def _trend(runs: list[dict], stage: int, mode: str) -> str | None:
    """'stage S, mode: N → M collectives as groups go from A to B'."""
    points = sorted((f["groups"], f["total"]) for r in runs
                    if r["spec"]["options"]["zero_optimization.stage"] == stage
                    and ("zero_optimization.allgather_bucket_size" in r["spec"]["options"])
                    == (mode == "per-group") and (f := _figures(r)))
    if len(points) < 2:
        return None
    (g0, t0), (g1, t1) = points[0], points[-1]
    return (f"- stage {stage}, {mode} all-gathers: {t0} → {t1} collectives per step as the "
            f"optimizer groups per rank go from {g0:,} to {g1:,} ({t1 / t0:.2f}× for "
            f"{g1 / g0:.0f}× the groups)")


def collectives_section(results: dict) -> list[str]:
    runs = [r for r in results["runs"] if r["spec"]["series"] == "collectives"]
    lines = [HEADING, ""]
    if not runs:
        return lines + ["Not run in this report."]
    m, t, machine = results["size"]["coll_model"], results["size"]["coll_train"], results["machine"]
    rows = [_row(r) for r in sorted(runs, key=_order)]
    trends = [line for s in COLLECTIVE_STAGES for mode in GATHER_MODES
              if (line := _trend(runs, s, mode))]
    return lines + [
        f"moezero at W = {WORLD_SIZE} (gloo), {m['n_layers']} layers × {m['num_experts']} "
        f"experts (ep {min(m['ep_size'], WORLD_SIZE)}: every group, experts too, is sharded "
        f"over both ranks), dim {m['dim']}, expert width {m['ffn_dim']}, fp32; "
        f"`moe.max_group_size` varies the number of optimizer groups of the same model. "
        f"Collectives counted on each rank (every `torch.distributed` call, wrapped) in the last "
        f"of {t['warmup'] + t['timed']} steps; the larger rank's count. Default "
        "`reduce_bucket_size` and `allgather_bucket_size` (5e7 elements); *per-group* sets "
        "`zero_optimization.allgather_bucket_size: null`, one all-gather per group (the "
        "behaviour before buckets).", "",
        f"Measured {machine['date']} on {machine['cpu']} ({machine['cores']} cores), torch "
        f"{machine['torch']}.", "",
        *table(["stage", "all-gathers", "max_group_size", "optimizer groups per rank",
                *OPS, "total per step", "step ms"], rows), "", *trends, "",
        "The all-reduces are the grad norm's and the logged loss's. Bucketed, stage 3 issues "
        "at most one all-gather per gather unit and pass (forward, backward): its count follows "
        "the units (the root, each block, each MoE layer's router and experts), not the groups; "
        "with few large groups, units share groups and gather fewer times. Step time still "
        "grows with the groups under buckets: the tiled step's own work is per group (the "
        "norm's partial sums, one AdamW per group, the copies out of each bucket); on this "
        "CPU it is the gap between the bucketed rows.", "",
        *commands(results, "collectives")]
