"""What a training run reports: the optimizer-group table, progress lines, the summary line and
the loss plot (``moezero.train`` calls these; no training logic here)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from moezero.zero.groups import OptimizerGroups


def param_groups_table(groups: OptimizerGroups) -> list[dict]:
    """``param_groups.json``: every optimizer group with members and per-rank ranges."""
    rows = []
    for g, part in zip(groups.plan, groups.partitions, strict=True):
        ranges = {str(r): list(part.rank_range(part.dp_rank(r))) for r in part.ranks}
        rows.append({"name": g.name, "index": g.index, "user_group": g.user_group,
                     "moe_group": g.moe_group, "ep_size": g.ep_size, "layer": g.layer,
                     "expert": g.expert, "numel": g.numel, "padded_numel": part.padded_numel,
                     "members": [{"fqn": m.fqn, "start": m.start, "stop": m.stop}
                                 for m in g.members],
                     "rank_ranges": ranges, **({"frozen": True} if g.frozen else {})})
    return rows


def print_group_table(groups: OptimizerGroups, out=sys.stdout) -> None:
    """Start-up table: group name, params, elements, bytes of fp32 optimizer state."""
    print(f"{'optimizer group':<44} {'params':>6} {'elements':>10} {'fp32 state':>11}", file=out)
    total = 0
    for g in groups.plan:
        state = 0 if g.frozen else g.numel * 12  # master + exp_avg + exp_avg_sq
        total += state
        print(f"{g.name:<44} {len(g.members):>6} {g.numel:>10,} {_mib(state):>11}", file=out)
    print(f"{len(groups.plan)} groups, {_mib(total)} of fp32 optimizer state in all", file=out)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def log_line(history: list[dict], steps: int, window: int) -> str:
    """The progress line of a log: the last step's loss terms under their ``metrics.jsonl``
    names (``loss`` = ``ce`` + ``aux_loss``, docs/data.md), and the peak memory of the last
    ``window`` steps (the logging window)."""
    row = history[-1]
    peak = max(r.get("peak_mem_bytes") or 0 for r in history[-window:])
    val = f" val_loss {row['val_loss']:.3f}" if "val_loss" in row else ""
    mfu = f" mfu {100 * row['mfu']:.1f}%" if row.get("mfu") is not None else ""
    load = row.get("moe_imbalance_max")
    return (f"step {row['step']}/{steps} {loss_terms(row)}{val} lr {row['lr']:.1e} "
            f"{row['tokens_per_s']:.0f} tokens/s{_trained(row)}{mfu} peak {_mib(peak)}"
            + (f" expert imbalance {load:.2f}" if load is not None else ""))


def loss_terms(row: dict) -> str:
    """``loss X ce Y aux_loss Z``: what is optimised and its two terms, as metrics.jsonl
    names them."""
    return f"loss {row['loss']:.3f} ce {row['ce']:.3f} aux_loss {row['aux_loss']:.3f}"


def _trained(row: dict) -> str:
    """`` (N trained)`` when a loss mask trains fewer tokens than the step saw."""
    trained = row.get("trained_tokens_per_s")
    return "" if trained is None or trained == row["tokens_per_s"] else f" ({trained:.0f} trained)"


SUMMARY_STEPS = 10
"""The summary's final figures are means over this many last steps."""


def summarize(history: list[dict], corpus) -> dict:
    """The final ``loss`` and ``ce`` (their means over the last ``SUMMARY_STEPS`` steps, which
    ``mean_steps`` names) and the last validation loss, beside the corpus's references."""
    tail = history[-SUMMARY_STEPS:]
    mean = lambda key: sum(r[key] for r in tail) / max(len(tail), 1)
    evals = [r for r in history if "val_loss" in r]
    return {"steps": len(history), "final_loss": mean("loss"), "final_ce": mean("ce"),
            "final_aux_loss": mean("aux_loss"),
            "mean_steps": (tail[0]["step"], tail[-1]["step"]) if tail else None,
            "val_loss": evals[-1]["val_loss"] if evals else None,
            "unigram_baseline": corpus.unigram_entropy, "entropy_floor": corpus.entropy_floor,
            "median_tokens_per_s": _median(history, "tokens_per_s") or 0.0,
            "median_trained_tokens_per_s": _median(history, "trained_tokens_per_s")}


def _median(history: list[dict], key: str) -> float | None:
    values = sorted(r[key] for r in history if r.get(key) is not None)
    return values[len(values) // 2] if values else None


def format_summary(s: dict, run_dir: Path) -> str:
    speed = {"tokens_per_s": s["median_tokens_per_s"],
             "trained_tokens_per_s": s.get("median_trained_tokens_per_s")}
    floor = f"{s['entropy_floor']:.3f}" if s["entropy_floor"] is not None else "n/a (text data)"
    val = "n/a" if s.get("val_loss") is None else \
        f"{s['val_loss']:.3f} (perplexity {math.exp(min(s['val_loss'], 700.0)):.2f})"
    first, last = s["mean_steps"] or (0, 0)
    return (f"done: {s['steps']} steps | final loss {s['final_loss']:.3f} = ce "
            f"{s['final_ce']:.3f} nats/token + aux_loss {s['final_aux_loss']:.3f} (means over "
            f"steps {first}-{last}) | val_loss {val} | "
            f"unigram baseline {s['unigram_baseline']:.3f} | "
            f"entropy floor {floor} | {s['median_tokens_per_s']:.0f} tokens/s per rank"
            f"{_trained(speed)} | "
            f"run dir {run_dir}")


def plot_loss(history: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in history], [r["ce"] for r in history], label="ce (training cross-entropy)")
    evals = [r for r in history if "val_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-",
                color="tab:orange", label="val_loss (validation cross-entropy)")
    ax.axhline(summary["unigram_baseline"], color="gray", ls="--", label="unigram baseline")
    if summary["entropy_floor"] is not None:
        ax.axhline(summary["entropy_floor"], color="green", ls=":", label="entropy floor")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("nats / token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def expert_load_grid(history: list[dict]) -> tuple[list[int], list[str], list[list[list[float]]]]:
    """What ``expert_load.png`` draws, from the rows' ``moe`` loads (as in metrics.jsonl):
    the steps, the MoE layers, and per layer [expert][step] the expert's share of the layer's
    kept assignments at that step (0 where the layer kept none)."""
    rows = [r for r in history if r.get("moe")]
    steps = [r["step"] for r in rows]
    names = [layer["layer"] for layer in rows[0]["moe"]] if rows else []
    grid = []
    for i in range(len(names)):
        loads = [r["moe"][i]["tokens_per_expert"] for r in rows]
        shares = [[n / max(sum(load), 1) for n in load] for load in loads]
        grid.append([list(col) for col in zip(*shares, strict=True)])
    return steps, names, grid


def draw_expert_load(history: list[dict], path: Path, tensorboard=None) -> None:
    """``expert_load.png``: one panel per MoE layer, experts × steps, colour = the expert's
    share of the layer's tokens (``expert_load_grid``); also a TensorBoard image when
    ``tensorboard`` (``moezero.telemetry.TensorBoard``) writes one. Nothing without MoE rows."""
    steps, names, grid = expert_load_grid(history)
    if not names:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.2 + 1.1 * len(names)), squeeze=False,
                             sharex=True)
    for ax, name, shares in zip(axes[:, 0], names, grid, strict=True):
        image = ax.imshow(shares, aspect="auto", interpolation="nearest", cmap="viridis",
                          vmin=0.0, extent=(steps[0] - 0.5, steps[-1] + 0.5,
                                            len(shares) - 0.5, -0.5))
        ax.set_ylabel(f"{name}\nexpert", fontsize=7)
        fig.colorbar(image, ax=ax, pad=0.01, label="share")
    axes[-1, 0].set_xlabel("optimizer step")
    fig.suptitle("expert load: each expert's share of its layer's routed tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    if tensorboard is not None:
        tensorboard.figure("moe/expert_load", fig, steps[-1])
    plt.close(fig)
