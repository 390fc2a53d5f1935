"""Statistics, targets, plots and the ``BENCHMARKS.md`` text, from raw run results.

Everything in the report is computed from ``results.json`` (written by ``benchmarks.run``);
nothing is typed in by hand. A run of only self-contained series (``SERIES_SECTIONS``)
rewrites only their sections of an existing report.
"""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks import (
    grouped,
    plots,
    tables_comm,
    tables_data,
    tables_estimate,
    tables_io,
    tables_memory,
    tables_scale,
)
from benchmarks.bigbase_report import TITLE as BIGBASE_HEADING
from benchmarks.finetune_families import SECTION as FAMILIES_HEADING
from benchmarks.finetune_report import SECTION as FINETUNE_HEADING
from benchmarks.fmt import mbs, mib, ok, splice, table, verdict
from benchmarks.gated_delta import SECTION as GATED_DELTA_HEADING
from benchmarks.gpu import SECTION as GPU_HEADING
from benchmarks.gpu_check import SECTION as GPU_CHECK_HEADING
from benchmarks.hoststep import SECTION as HOSTSTEP_HEADING
from benchmarks.nvme_phases import HEADING as NVME_HEADING
from benchmarks.specs import MOEZERO_CONFIGS, PEER_CONFIGS, TARGET_CONFIG
from benchmarks.stats import by_name, limits, param_count

IMPORT_DS_HEADING = "## `import-deepspeed` of a 1.1 GB ZeRO-2 native-MoE checkpoint (issue 27)"
"""Written from a run of ``benchmarks/deepspeed_import.py`` (outside this harness); kept."""
MEMORY_HEADING = "## Where the main table's memory goes (issue 28)"
"""The main model's per-rank anonymous memory phase by phase (``benchmarks.memory_phases``, runs
of its own, not of this harness) and the causes found; kept from the report a run replaces,
like the scale and hoststep sections."""

# ----------------------------------------------------------------------------- targets


def _target_config(stats: dict) -> tuple[str | None, str]:
    if stats.get(TARGET_CONFIG, {}).get("status") == "ok":
        return TARGET_CONFIG, ""
    measured = [n for n, _ in MOEZERO_CONFIGS if stats.get(n, {}).get("status") == "ok"]
    if not measured:
        return None, "no moezero configuration ran"
    return measured[-1], f"{TARGET_CONFIG} not supported yet: measured on {measured[-1]}"


def _ratio_target(label, moe, peer, peer_name, key, kind) -> dict:
    row = {"target": label, "measured": "", "status": ""}
    if peer is None or peer.get("status") != "ok":
        why = peer["reason"] if peer else "not run"
        row["status"] = f"not measured: {peer_name} {peer['status'] if peer else ''} ({why})"
    elif moe.get(key) is None:
        row["status"] = f"not measured: moezero checkpoint {moe.get('ckpt_note') or 'n/a'}"
    elif peer.get(key) is None:
        row["status"] = f"not measured: {peer_name} has no figure"
    else:
        value = moe[key] / peer[key]
        row.update(measured=f"{value:.2f}× of {peer_name}", status=verdict(value, 1.0, kind))
    return row


def targets(stats: dict, lim: dict, large: dict | None = None) -> tuple[list[dict], str, str]:
    """The issue's targets with measured ratio and status; plus the config and a note."""
    name, note = _target_config(stats)
    if name is None:
        return [], "", note
    moe = stats[name]
    fsdp, ds = (stats.get(n) for n, _, _ in PEER_CONFIGS[:2])
    f_name, d_name = (n for n, _, _ in PEER_CONFIGS[:2])
    rows = [
        _ratio_target("step throughput ≥ FSDP2's", moe, fsdp, f_name, "tokens_per_s", ">="),
        _ratio_target("step throughput ≥ DeepSpeed's", moe, ds, d_name, "tokens_per_s", ">="),
        _memory_target("per-rank peak memory ≤ FSDP2's", moe, fsdp, f_name),
        _memory_target("per-rank peak memory ≤ DeepSpeed's", moe, ds, d_name),
        *_save_targets(moe, large, lim),
        _ratio_target("checkpoint bytes ≤ DCP's", moe, fsdp, f_name, "ckpt_bytes", "<="),
        _ratio_target("checkpoint bytes < DeepSpeed's", moe, ds, d_name, "ckpt_bytes", "<"),
    ]
    return rows, name, note


def _memory_target(label: str, moe: dict, peer: dict | None, peer_name: str) -> dict:
    """Judged on peak anonymous memory; the peak-RSS ratio is shown beside it."""
    row = _ratio_target(label, moe, peer, peer_name, "anon_peak", "<=")
    if row["measured"]:
        rss = moe["peak_rss"] / peer["peak_rss"]
        row["measured"] = (f"{row['measured']} (peak anon); peak RSS {rss:.2f}×: "
                           f"{verdict(rss, 1.0, '<=')}")
    return row


def _save_targets(moe: dict, large: dict | None, lim: dict) -> list[dict]:
    """Save bandwidth against dd: judged on the large (bandwidth-bound) checkpoint, the mean of
    its two saves' fractions of the dd beside each; the small one, bound by fixed costs, is
    shown beside it (its first save)."""
    keys = ("save_s", "second_save_s")
    rows = [("checkpoint save ≥ 80% of dd write bandwidth (large checkpoint, mean of its two "
             "saves; section below)", large if ok(large) else None, keys,
             "large checkpoint not run"),
            ("the same on the small checkpoint (main model, first save; fixed-cost bound)", moe,
             keys[:1], f"moezero checkpoint {moe.get('ckpt_note') or 'n/a'}")]
    out = []
    for label, s, which, missing in rows:
        row = {"target": label, "measured": "", "status": ""}
        saved = s is not None and all(s.get(k) is not None for k in which)
        fracs = [tables_io.save_vs_dd(s, k, lim) for k in which] if saved else []
        if not saved:
            row["status"] = f"not measured: {missing}"
        elif any(f is None for f, _ in fracs):
            row["status"] = "not measured: no dd"
        else:
            frac = sum(f for f, _ in fracs) / len(fracs)
            row.update(measured=f"{100 * frac:.0f}% {fracs[0][1]} write",
                       status=verdict(frac, 0.8, ">="))
        out.append(row)
    return out


# ----------------------------------------------------------------------------- text


def _result_row(name: str, s: dict, lim: dict, params: int) -> list:
    if s["status"] != "ok":
        return [name, f"{s['status']}: {s['reason']}"] + ["–"] * 10
    if s.get("ckpt_bytes") is not None:
        frac = f" ({100 * s['save_bw'] / lim['dd_write']:.0f}% of dd)" if "dd_write" in lim else ""
        ckpt = [f"{s['ckpt_bytes']:,.0f} ({s['ckpt_bytes'] / params:.1f} B/param)",
                f"{s['save_s']:.2f} s", mbs(s["save_bw"]) + frac]
    else:
        ckpt = [s.get("ckpt_note") or "–", "–", "–"]
    low, high = s["tokens_per_s_range"]
    spread = f" ({low:,.0f}–{high:,.0f})" if s["runs"] > 1 else ""
    return [name, "ok", f"{s['tokens_per_s']:,.0f}{spread}", f"{s['step_ms']:.0f}",
            f"{s['step_call_ms']:.1f}", mib(s["peak_rss"]), mib(s["anon_peak"]),
            mib(s["anon_growth"]), *ckpt,
            f"{s['loss_first']:.2f} → {s['loss_last']:.2f}"]


def _ratio_rows(stats: dict) -> list[list]:
    rows = []
    for m, _ in MOEZERO_CONFIGS:
        for p, _, _ in PEER_CONFIGS:
            a, b = stats.get(m, {}), stats.get(p, {})
            if a.get("status") != "ok" or b.get("status") != "ok":
                continue
            cells = [f"{a[k] / b[k]:.2f}×" if a.get(k) and b.get(k) else "n/a"
                     for k in ("tokens_per_s", "anon_peak", "peak_rss", "ckpt_bytes")]
            rows.append([m, p, *cells])
    return rows


def _sweep_rows(anon: dict, rss: dict) -> list[list]:
    experts = sorted({e for series in anon.values() for e in series})
    return [[e, *(f"{mib(anon[n].get(e))} / {mib(rss[n].get(e))}" for n in anon)]
            for e in experts]


def _machine_lines(results: dict) -> list[str]:
    m, peer = results["machine"], results["peer"]
    ds = (f"DeepSpeed {peer['deepspeed']} (torch {peer['torch']}, accelerator "
          f"{peer['accelerator']}) in the peer venv" if "deepspeed" in peer
          else f"DeepSpeed unavailable: {peer.get('error')}")
    mem = f"{m['mem_bytes'] / 2**30:.1f} GiB" if m.get("mem_bytes") else "unknown"
    return [f"- CPU: {m['cpu']}, {m['cores']} cores; memory {mem}; {m['os']}",
            f"- Python {m['python']}, torch {m['torch']}; {ds}",
            f"- Date: {m['date']}; whole run took {results.get('elapsed_s', 0) / 60:.1f} min"]


def _setup_lines(results: dict) -> list[str]:
    model, train, size = results["size"]["model"], results["size"]["train"], results["size"]
    return [f"Mode `{results['mode']}`: Mixtral-style decoder of {param_count(model):,} "
            f"parameters (fp32 weights + AdamW state = {12 * param_count(model):,} bytes), "
            f"dim {model['dim']}, "
            f"{model['n_layers']} layers, {model['n_heads']} heads, {model['num_experts']} SwiGLU "
            f"experts of width {model['ffn_dim']}, top-{model['top_k']}, vocab "
            f"{model['vocab_size']}; micro-batch {train['micro_batch_size']} × "
            f"{train['seq_len']} tokens per rank; W = 2 (gloo, one thread per rank); fp32; "
            f"AdamW lr {train['lr']} constant, clipping 1.0; synthetic corpus "
            f"(moezero.data). Each run: fresh `torchrun` processes, {train['warmup']} "
            f"warm-up + {train['timed']} timed steps; {results.get('repeats', size['repeats'])} "
            "interleaved rounds of the compared configurations (stage 3 / offload rows: "
            f"{size.get('slot_rounds', 'all')} round(s)), then the other series once each "
            "(each section below says its model, loop and command)."]


def render(results: dict, plot_links: dict[str, str]) -> str:
    """The whole BENCHMARKS.md text."""
    stats, lim = by_name(results), limits(results)
    sections = [
        ["# Benchmarks", "", "Generated by `benchmarks/run.py` from one run; do not edit by "
         "hand. Compare ratios within this run, not absolute figures across runs (shared 2-core "
         "VM)."],
        ["## Machine", "", *_machine_lines(results)],
        ["## Command", "", "```", results["command"], "```", "", *_setup_lines(results)],
        _limit_section(lim),
        _results_section(results, stats, lim),
        ["## Ratios (moezero / peer)", "",
         *table(["moezero", "peer", "tokens/s", "peak anon", "peak RSS", "checkpoint bytes"],
                 _ratio_rows(stats)), "",
         "Throughput above 1× is better; memory and bytes below 1× are better."],
        _targets_section(stats, lim, by_name(results, "ckpt").get(MOEZERO_CONFIGS[2][0])),
        [MEMORY_HEADING, "", "Not measured yet: `torchrun --standalone --nproc_per_node 2 "
         "-m benchmarks.memory_phases` (per phase, on each rank)."],
        tables_memory.tiled_section(results),
        tables_memory.stages_section(results),
        tables_io.ckpt_section(results, lim),
        tables_io.nvme_ckpt_section(results, lim),
        tables_io.optimizer_section(results, lim),
        tables_memory.world_section(results),
        _sweep_section(results, plot_links),
        tables_memory.slots_section(results),
        tables_io.swap_section(results),
        grouped.section(results),
        tables_data.data_section(results),
        tables_comm.collectives_section(results),
        tables_estimate.estimate_section(results),
        _failure_section(results),
    ]
    return "\n\n".join("\n".join(section) for section in sections) + "\n"


def _results_section(results: dict, stats: dict, lim: dict) -> list[str]:
    params = param_count(results["size"]["model"])
    header = ["configuration", "status", "tokens/s per rank", "step ms", "step() ms",
              "peak RSS per rank", "peak anon per rank", "anon growth", "checkpoint bytes",
              "save time", "save bandwidth", "loss first → last"]
    rows = [_result_row(n, s, lim, params) for n, s in stats.items()]
    return ["## Results (median over rounds)", "", *table(header, rows), "", *NOTES_RESULTS]


def _targets_section(stats: dict, lim: dict, large: dict | None) -> list[str]:
    rows, name, note = targets(stats, lim, large)
    lines = ["## Targets", ""]
    if note:
        lines += [f"Evaluated on **{name or 'nothing'}**: {note}.", ""]
    return lines + table(["target", "measured", "status"],
                          [[r["target"], r["measured"] or "–", r["status"]] for r in rows])


def _limit_section(lim: dict) -> list[str]:
    dd = ([["dd write (oflag=direct, bs=8M)", mbs(lim["dd_write"])],
           ["dd read (iflag=direct, bs=8M)", mbs(lim["dd_read"])],
           ["dd write through the page cache (conv=fsync, bs=8M)",
            mbs(lim.get("dd_write_buffered"))]] if "dd_write" in lim
          else [["dd", f"failed: {lim['dd_error']}"]])
    return ["## Machine limits (measured in this run)", "",
            *table(["limit", f"median over {lim['rounds']} round(s)"],
                    [*dd, ["memory copy (torch, 1 thread, read + write bytes)",
                           f"{lim['memcpy'] / 1e9:.1f} GB/s"]])]


def _sweep_section(results: dict, plot_links: dict[str, str]) -> list[str]:
    anon, rss = plots.sweep_points(results, "anon_peak"), plots.sweep_points(results, "peak_rss")
    lines = ["## Per-rank peak memory against experts per layer", ""]
    if not anon:
        return lines + ["No sweep runs."]
    return lines + [f"![peak memory per rank vs experts]({plot_links['memory']})", "",
                    *table(["experts", *(f"{n}: peak anon / peak RSS" for n in anon)],
                            _sweep_rows(anon, rss)),
                    "", f"Per-run throughput: ![tokens/s per run]({plot_links['throughput']})"]


FAILURES = "## Not run, rejected or failed"


def _failure_section(results: dict) -> list[str]:
    lines = [FAILURES, ""]
    peer = results["peer"]
    if "error" in peer:
        lines.append(f"- DeepSpeed peer setup: {peer['error']}")
    seen = set()
    for run in results["runs"]:
        if run.get("exit_note"):
            lines.append(f"- {run['spec']['name']} ({run['tag']}): measured, then {run['exit_note']}")
    for run in results["runs"]:
        name = run["spec"]["name"]
        if run["status"] == "ok" or name in seen:
            continue
        seen.add(name)
        why = run.get("error") or run["ranks"][0].get("note")
        lines.append(f"- {name}: {run['status']} — {why} (log: `{run['tag']}.log`)")
    return lines + (["- nothing"] if len(lines) == 2 else [])


NOTES_RESULTS = [
    "- tokens/s per rank: local tokens per step / median step time (after warm-up), mean of the "
    "ranks; median over rounds, (min–max) of the rounds in brackets. step(): the step call alone — moezero `engine.reduce_gradients()` + "
    "`engine.optimizer_step()` (the reduction left after backward, the optimizer and, at stages "
    "1–2, the parameter all-gather); FSDP2 `optimizer.step()`; DeepSpeed `engine.step()` "
    "(optimizer + parameter all-gather).",
    "- peak RSS per rank: `VmHWM` (peak resident set) of the larger rank after training (before the save). It "
    "counts library pages mapped from disk, whose residency depends on the venv and the page "
    "cache (DeepSpeed runs in its own venv), so the memory targets use peak anon: resident "
    "anonymous memory (RSS minus file-backed and shared pages, `/proc/self/statm`), sampled "
    "every 10 ms from before the model is built to the end of training; anon growth: that peak "
    "minus the rank's anonymous memory after imports.",
    "- Checkpoints: FSDP2 via `torch.distributed.checkpoint` (model + optimizer), DeepSpeed "
    "`save_checkpoint`; time from a barrier before to a barrier after the save on every rank. "
    "Small checkpoints may land in the page cache, so save bandwidth can exceed dd's direct I/O.",
    "- FSDP2 has no expert parallelism: it shards every parameter over both ranks and runs all "
    "experts on each; moezero and DeepSpeed use expert parallelism ep = 2.",
]
SERIES_SECTIONS = {"grouped": grouped.section, "collectives": tables_comm.collectives_section,
                   "tiled": tables_memory.tiled_section,
                   "estimate": tables_estimate.estimate_section, "scale": tables_scale.scale_section}
"""Series whose results fill sections of their own: a run of only these series rewrites only
those sections of an existing report (``update_sections``), keeping every other section."""


def sections_only(series: list[str]) -> bool:
    """True when every requested series owns its sections (and at least one was requested)."""
    return bool(series) and all(name in SERIES_SECTIONS for name in series)


def update_sections(results: dict, out: Path, series: list[str]) -> str:
    """Rewrite only the given series' sections of the report at ``out`` (created if missing);
    returns the text."""
    text = out.read_text() if out.exists() else "# Benchmarks\n"
    for name in series:
        text = splice(text, SERIES_SECTIONS[name](results))
    out.write_text(text)
    return text


OWN_RUNS = (HOSTSTEP_HEADING, NVME_HEADING, FINETUNE_HEADING, FAMILIES_HEADING,
            GATED_DELTA_HEADING, IMPORT_DS_HEADING, MEMORY_HEADING, BIGBASE_HEADING,
            GPU_HEADING, GPU_CHECK_HEADING)
"""Sections written by runs of their own (the hoststep, nvme, finetune, gated-delta, bigbase
and GPU series, the import-deepspeed row, the memory attribution): a run of the main series
keeps the last of each from the report it replaces."""


def write(results: dict, out: Path, plots_dir: Path) -> str:
    """Plots then BENCHMARKS.md; returns the text."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    files = {"memory": plots_dir / "memory_vs_experts.png",
             "throughput": plots_dir / "throughput.png"}
    plots.memory_vs_experts(results, files["memory"])
    plots.throughput(results, files["throughput"])
    base = out.resolve().parent
    links = {k: Path(os.path.relpath(v.resolve(), base)).as_posix() for k, v in files.items()}
    text = render(results, links)
    if "data_prep" not in results and out.exists():  # keep the last data series measured
        kept = tables_data.existing_section(out.read_text())
        text = splice(text, kept) if kept else text
    if out.exists():  # and the last scale series (a run of its own: benchmarks.scale)
        kept = tables_data.existing_section(out.read_text(), tables_scale.HEADING)
        text = splice(text, kept) if kept else text
    for heading in OWN_RUNS:
        kept = out.exists() and tables_data.existing_section(out.read_text(), heading)
        text = splice(text, kept) if kept else text
    out.write_text(text)
    return text


def console_summary(text: str) -> str:
    """The results, ratios and targets sections, for the terminal (the whole text when it has
    none: the sections of a single-series run)."""
    if "## Results" not in text or "## Tiled vs untiled" not in text:
        return text.rstrip()
    start = text.index("## Results")
    end = text.index("## Tiled vs untiled")
    return text[start:end].rstrip()
