"""PNG plots for BENCHMARKS.md (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from statistics import median

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.specs import SWEEP_SYSTEMS
from benchmarks.stats import run_stats

MiB = 2**20


def sweep_points(results: dict, key: str = "anon_peak") -> dict[str, dict[int, float]]:
    """System name -> {experts: median per-rank figure}, from the sweep and the main runs."""
    points: dict[str, dict[int, list[float]]] = {name: {} for name, _, _ in SWEEP_SYSTEMS}
    for run in results["runs"]:
        name = run["spec"]["name"]
        if run["status"] != "ok" or name not in points or run["spec"]["series"] not in (
                "main", "sweep"):
            continue
        experts = run["spec"]["model"]["num_experts"]
        points[name].setdefault(experts, []).append(run_stats(run)[key])
    return {n: {e: median(v) for e, v in sorted(p.items())} for n, p in points.items() if p}


def memory_vs_experts(results: dict, path: Path) -> None:
    """Peak anonymous memory and peak RSS per rank against experts per layer."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "anon_peak", "peak anonymous memory per rank"),
                           (axes[1], "peak_rss", "peak RSS per rank (incl. mapped libraries)")):
        for name, series in sweep_points(results, key).items():
            ax.plot(list(series), [v / MiB for v in series.values()], marker="o", label=name)
        ax.set_xlabel("experts per MoE layer")
        ax.set_ylabel("MiB")
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ticks = sorted({e for series in sweep_points(results).values() for e in series})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.legend()
    fig.suptitle(f"W=2, {results['mode']} model; {results['machine']['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def throughput(results: dict, path: Path) -> None:
    """Tokens/s per rank of every main run, one column per configuration, median marked."""
    runs = [r for r in results["runs"] if r["spec"]["series"] == "main" and r["status"] == "ok"]
    names = list(dict.fromkeys(r["spec"]["name"] for r in runs))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, name in enumerate(names):
        values = [run_stats(r)["tokens_per_s"] for r in runs if r["spec"]["name"] == name]
        ax.scatter([i] * len(values), values, alpha=0.6)
        ax.hlines(median(values), i - 0.25, i + 0.25, color="black")
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel("tokens/s per rank")
    ax.set_ylim(bottom=0)
    ax.set_title("each run (dots) and the median (bar)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
