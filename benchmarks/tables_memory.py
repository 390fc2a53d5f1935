"""Report sections about memory: tiled vs untiled step, stages vs FSDP2, memory vs W, and the
stage 3 / offload rows. Every figure comes from ``results.json``; see ``benchmarks.specs``."""

from __future__ import annotations

from benchmarks.fmt import commands, mib, ok, pct, table, verdict, why_not
from benchmarks.specs import SLOT_CONFIGS, STATE_SYSTEMS, TILED_ROWS, WORLD_SIZE, WORLD_SYSTEMS
from benchmarks.stats import by_name, point

TILED_TARGET = 0.20
FSDP2 = "FSDP2 + DCP"


def _spec(results: dict, series: str, name: str) -> dict | None:
    return next((r["spec"] for r in results["runs"]
                 if r["spec"]["series"] == series and r["spec"]["name"] == name), None)


# ----------------------------------------------------------------------------- A: tiled step


def _tiled_row(name: str, s: dict | None) -> list:
    if not ok(s) or s.get("engine_peak") is None:
        return [name, why_not(s) if not ok(s) else "no engine figures"] + ["–"] * 5
    return [name, f"{s['engine_peak']:,.0f}", f"{s['persistent']:,.0f}",
            f"{s['engine_peak'] - s['persistent']:,.0f}", f"{mib(s['anon_peak'])} / "
            f"{mib(s['peak_rss'])}", f"{s.get('optimizer_ms', 0):.0f}", f"{s['step_ms']:.0f}"]


def _saving(a: dict, b: dict, key: str) -> float:
    return 1 - a[key] / b[key]


def _tiled_target(dtype: str, tiled: dict | None, untiled: dict | None) -> list:
    if not (ok(tiled) and ok(untiled) and tiled.get("engine_peak") and untiled.get("engine_peak")):
        return [dtype, "not measured", "–", "–", "–", "–"]
    save = _saving(tiled, untiled, "engine_peak")
    bound = 1 - untiled["persistent"] / untiled["engine_peak"]
    t_tr = tiled["engine_peak"] - tiled["persistent"]
    u_tr = untiled["engine_peak"] - untiled["persistent"]
    status = verdict(save, TILED_TARGET, ">=")
    return [dtype, f"{pct(save)} ({tiled['engine_peak']:,.0f} vs {untiled['engine_peak']:,.0f} B)",
            f"**{status}**", pct(bound), pct(1 - t_tr / u_tr) if u_tr else "–",
            f"{pct(_saving(tiled, untiled, 'anon_peak'))} / "
            f"{pct(_saving(tiled, untiled, 'peak_rss'))}"]


def tiled_section(results: dict) -> list[str]:
    stats = by_name(results, "tiled")
    lines = ["## Tiled vs untiled optimizer step (issue 5)", ""]
    if not stats:
        return lines + ["Not run in this report."]
    model, train = results["size"]["tiled_model"], results["size"]["tiled_train"]
    rows = [_tiled_row(name, stats.get(name)) for name, _ in TILED_ROWS]
    dtypes = dict.fromkeys(opts["precision.dtype"] for _, opts in TILED_ROWS)
    targets = [_tiled_target(d, stats.get(f"stage 2 {d} tiled"), stats.get(f"stage 2 {d} untiled"))
               for d in dtypes]
    first = TILED_ROWS[0][0]
    return lines + [
        f"moezero ZeRO-2, W = {WORLD_SIZE}, {model['num_experts']} experts (ep "
        f"{model['ep_size']}), dim {model['dim']}, expert width {model['ffn_dim']}, "
        f"{model['n_layers']} layers, `moe.max_group_size` = 32768, micro-batch "
        f"{train['micro_batch_size']} × {train['seq_len']} tokens (activations small, optimizer "
        f"state dominates); {train['warmup']} warm-up + {train['timed']} timed steps, one run "
        "per row.", "",
        *table(["row", "engine step peak (B)", "persistent (B)", "transient = peak − "
                "persistent (B)", "process peak anon / RSS per rank", "optimizer_step() ms",
                "step ms"], rows), "",
        *table(["dtype", "tiled saves, of the untiled whole engine step peak",
                f"target ≥ {TILED_TARGET:.0%}", "most any tiling could save (untiled transient "
                "/ untiled peak)", "transient saving", "process peak saving (anon / RSS)"],
               targets), "",
        "- engine step peak: `step_peak_engine_bytes` of the step's metrics (the engine's "
        "`MemoryMeter`: persistent partitions — exp_avg, exp_avg_sq, the grad partition and, "
        "in bf16, the fp32 master (in fp32 the master is the params' own range, no copy) — plus "
        "the step's temporaries while alive), the largest over steps and ranks. "
        "The 20% target is judged on this whole peak, persistent state included; the transient "
        "columns leave the persistent bytes out.",
        "- The untiled step holds every group's fp32 gradient (4 B per local element) on top of "
        "the persistent state (12 B/element in fp32: moments and the grad partition; 14 in "
        "bf16: master, moments, bf16 grad partition), so even a zero-cost tiled step saves at "
        "most ~4/16 = 25% in fp32 and 4/18 = 22% in bf16: the 'most any tiling could save' "
        "column.",
        "- Process peak: peak anonymous memory and peak RSS of the larger rank over the whole "
        "run (model build, backward's full-size gradients, the step). When the peak is set "
        "outside the optimizer step (backward holds every local gradient at once), tiling does "
        "not lower it.", "",
        *commands(results, "tiled", _spec(results, "tiled", first),
                  " (first row; the others set `zero_optimization.tiled_step` / "
                  "`precision.dtype`)")]


# ----------------------------------------------------------------------------- B: stages vs FSDP2


def _state_model(results: dict) -> str:
    m, t = results["size"]["tiled_model"], results["size"]["short"]
    return (f"The tiled-step model ({m['num_experts']} experts, dim {m['dim']}, expert width "
            f"{m['ffn_dim']}, {m['n_layers']} layers; micro-batch {t['micro_batch_size']} × "
            f"{t['seq_len']} tokens per rank, so the optimizer state dominates), fp32, default "
            f"moezero settings; {t['warmup']} warm-up + {t['timed']} timed steps, one run each. "
            "Same memory measures for both systems: peak anonymous memory and peak RSS of the "
            "larger rank. FSDP2 shards every parameter over the W ranks and runs all experts "
            "on each; moezero uses ep = min(2, W).")


def stages_section(results: dict) -> list[str]:
    lines = ["## Per-rank memory on the state-dominated model: stages 0/1/2 vs FSDP2 (issue 5)",
             ""]
    stats = {n: point(results, "state", n, world=WORLD_SIZE) for n, _, _ in STATE_SYSTEMS}
    if not any(stats.values()):
        return lines + ["Not run in this report."]
    peer = stats.get(FSDP2)
    rows = []
    for name, s in stats.items():
        if not ok(s):
            rows.append([name, why_not(s), "–", "–", "–"])
            continue
        ratio = [f"{s[k] / peer[k]:.2f}×" if ok(peer) else "–" for k in ("anon_peak", "peak_rss")]
        rows.append([name, mib(s["anon_peak"]), mib(s["peak_rss"]), *ratio])
    lines += table(["configuration", "peak anon per rank", "peak RSS per rank",
                    "anon / FSDP2", "RSS / FSDP2"], rows)
    stage2 = stats.get("moezero stage 2")
    if ok(stage2) and ok(peer):
        a, r = (stage2[k] / peer[k] for k in ("anon_peak", "peak_rss"))
        lines += ["", f"Target: stage 2 per-rank memory ≤ FSDP2's: peak anon {a:.2f}× → "
                  f"**{verdict(a, 1.0, '<=')}**; peak RSS {r:.2f}× → **{verdict(r, 1.0, '<=')}**."]
    return lines + ["", f"W = {WORLD_SIZE}. " + _state_model(results), "",
                    *commands(results, "state", _spec(results, "state", "moezero stage 2"))]


# ----------------------------------------------------------------------------- E: memory vs W


def world_section(results: dict) -> list[str]:
    lines = ["## Per-rank memory as W grows (issue 8)", ""]
    if not any(r["spec"]["series"] == "state" for r in results["runs"]):
        return lines + ["Not run in this report."]
    rows = []
    for w in results["size"].get("world_sizes", ()):
        cells = [point(results, "state", n, world=w) for n in WORLD_SYSTEMS]
        row = [w] + [f"{mib(s['anon_peak'])} / {mib(s['peak_rss'])}" if ok(s) else why_not(s)
                     for s in cells]
        moe, peer = cells[0], cells[-1]
        row.append(f"{moe['anon_peak'] / peer['anon_peak']:.2f}× / "
                   f"{moe['peak_rss'] / peer['peak_rss']:.2f}×" if ok(moe) and ok(peer) else "–")
        rows.append(row)
    header = ["W", *(f"{n}: peak anon / RSS per rank" for n in WORLD_SYSTEMS),
              f"{WORLD_SYSTEMS[0]} / {WORLD_SYSTEMS[-1]} (anon / RSS)"]
    return lines + [*table(header, rows), "",
                    "Same per-rank batch at every W (the global batch grows with W). "
                    + _state_model(results) + " W = 4 runs 4 ranks on 2 cores.", "",
                    *commands(results, "state", only=WORLD_SYSTEMS)]


# ----------------------------------------------------------------------------- F: stage 3, offload


def _slot_row(name: str, base_name: str, stats: dict) -> list:
    s, base = stats.get(name), stats.get(base_name)
    if not ok(s):
        return [name, why_not(s)[:160], base_name] + ["–"] * 4
    ratio = (lambda k: f"{s[k] / base[k]:.2f}×" if ok(base) else "–")
    return [name, "ok", base_name, f"{s['step_ms']:.0f} ({ratio('step_ms')})",
            f"{s.get('optimizer_ms', float('nan')):.0f}",
            f"{mib(s['anon_peak'])} ({ratio('anon_peak')})",
            f"{mib(s['peak_rss'])} ({ratio('peak_rss')})"]


def slots_section(results: dict) -> list[str]:
    stats = by_name(results, "main")
    rows = [_slot_row(name, base, stats) for name, _, base in SLOT_CONFIGS]
    return ["## Stage 3 and offload (slots that fill in when the engine has them)", "",
            *table(["configuration", "status", "compared with", "step ms (× that)",
                    "optimizer_step() ms", "peak anon per rank (× that)",
                    "peak RSS per rank (× that)"], rows), "",
            "Main model and loop, run with the compared configurations (quick mode: first round "
            "only). Stage 3 is compared with FSDP2 (memory per rank); offload rows with the same "
            "stage without offload (step time). NVMe swap files go under the bench work dir "
            "(`bench_out/nvme`).", "",
            *commands(results, "main", only=("stage 3", "offload"))]
