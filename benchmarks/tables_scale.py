"""Report section of the ``scale`` series (``benchmarks.scale``): an MoE larger than memory on
NVMe, beside the nearest DeepSpeed configuration, from ``results-scale.json``."""

from __future__ import annotations

from statistics import median

from benchmarks.fmt import harness_command, table
from benchmarks.nvme_phases import PHASES, phase_figures, phase_table
from benchmarks.specs import SCALE_OPTIONS, SCALE_TARGETS
from benchmarks.stats import param_count

HEADING = "## An MoE larger than memory, trained from NVMe (issue 16)"
GB = 1e9


def _dd(results: dict) -> dict | None:
    """Mean of the dd read and write bandwidths before and after the run (bytes/s)."""
    pair = [results.get("dd_before", {}), results.get("dd_after", {})]
    if any("error" in d or not d for d in pair):
        return None
    return {k: sum(d[k] for d in pair) / 2 for k in ("read", "write")}


def figures(results: dict) -> dict | None:
    """The moezero run's figures: the larger rank's memory, the slower rank's times, bytes per
    step summed over the ranks (one disk), the disk time of those bytes at dd's speed."""
    run = results.get("run") or {}
    if run.get("status") != "ok":
        return None
    ranks = run["ranks"]
    steps = [[s for s in r["steps"]] for r in ranks]
    step_s = median(max(r[i]["s"] for r in steps) for i in range(len(steps[0])))
    per_step = {k: median(sum(r[i][k] for r in steps) for i in range(len(steps[0])))
                for k in ("read", "write", "swap")}
    out = {"peak_rss": max(r["peak_rss"] for r in ranks),
           "anon_peak": max(r["anon_peak"] for r in ranks),
           "init_s": max(r["init_s"] for r in ranks), "step_s": step_s,
           "step_list": [max(r[i]["s"] for r in steps) for i in range(len(steps[0]))],
           "save_s": max(r["save_s"] for r in ranks), "load_s": max(r["load_s"] for r in ranks),
           "ckpt_bytes": ranks[0]["ckpt_bytes"], "losses": [s["loss"] for s in steps[0]],
           "resumed_loss": ranks[0]["resumed"]["loss"], "resumed_s": ranks[0]["resumed"]["s"],
           "phases": {k: max(r["phase_rss"][k] for r in ranks) for k in ranks[0].get("phase_rss", {})},
           **per_step}
    if all(s.get("phases") for r in steps for s in r):  # runs since issue 28: the step by phase
        rows = list(zip(*steps, strict=True))
        out["step_phases"] = {p: phase_figures(rows, p) for p in PHASES}
    dd = _dd(results)
    if dd is not None:
        out["disk_s"] = per_step["read"] / dd["read"] + per_step["write"] / dd["write"]
        out["ratio"] = step_s / out["disk_s"] if out["disk_s"] else None
    return out


def _env(results: dict) -> str:
    """The ranks' extra environment: none now; results of earlier runs (``--from-json``) may
    record one (``MALLOC_MMAP_THRESHOLD_`` before the engine set glibc's threshold itself)."""
    env = results.get("env") or {}
    return ", ".join(f"`{k}={v}`" for k, v in env.items()) or "the default environment"


def _gib(n) -> str:
    return "–" if n is None else f"{n / 2**30:.2f} GiB"


def _rows(f: dict | None, results: dict, params: int) -> list[list]:
    run = results.get("run") or {}
    if f is None:
        why = run.get("error") or (run.get("ranks") or [{}])[0].get("note") or "not run"
        rows = [["moezero", f"{params / 1e9:.2f} B", f"failed: {why}"] + ["–"] * 7]
    else:
        ratio = "–" if f.get("ratio") is None else f"{f['ratio']:.2f}×"
        rows = [["moezero", f"{params / 1e9:.2f} B", _gib(f["peak_rss"]), _gib(f["anon_peak"]),
                 f"{f['init_s']:.0f} s", f"{f['step_s']:.1f} s",
                 f"{f['read'] / GB:.1f} / {f['write'] / GB:.1f} GB", ratio,
                 f"{f['save_s']:.0f} s", f"{f['load_s']:.0f} s"]]
    rows.append(_peer_row(results.get("peer") or {}))
    return rows


def _largest(value):
    """A figure the peer gives per rank (a list, None where a rank has none) or once."""
    if isinstance(value, list):
        value = max((v for v in value if v is not None), default=None)
    return value


def _peer_row(peer: dict) -> list:
    """DeepSpeed's row: its figures (the larger rank), its error line when it stopped."""
    if not peer.get("params"):
        return ["DeepSpeed (peer)", "–", peer.get("error") or "not run"] + ["–"] * 7
    swap, step = _largest(peer.get("swap_bytes")), _largest(peer.get("step_s"))
    init = _largest(peer.get("init_s"))
    return ["DeepSpeed (peer)", f"{peer['params'] / 1e9:.2f} B",
            _gib(_largest(peer.get("peak_rss_bytes"))), _gib(_largest(peer.get("peak_anon_bytes"))),
            "–" if init is None else f"{init:.0f} s",
            "–" if step is None else f"{step:.1f} s",
            "–" if swap is None else f"(its swap files: {swap / GB:.1f} GB)",
            "–" if peer.get("ok") else f"stopped: {peer.get('error')}", "–", "–"]


def _verdicts(f: dict | None, params: int, experts: int) -> list[str]:
    if f is None:
        return ["- Targets: no figures (the run did not finish)."]
    rss_ok = f["peak_rss"] <= SCALE_TARGETS["rss_bytes"]
    ratio = f.get("ratio")
    ratio_line = ("no dd figure" if ratio is None else
                  f"{ratio:.2f}× ({'met' if ratio <= SCALE_TARGETS['disk_ratio'] else 'missed'}, "
                  f"target ≤ {SCALE_TARGETS['disk_ratio']}×)")
    size_ok = params >= SCALE_TARGETS["params"] and experts >= SCALE_TARGETS["experts"]
    return [f"- Size: {params / 1e9:.2f} B parameters, {experts} experts per MoE layer "
            f"({'met' if size_ok else 'below the target of 2 B and 32: a quick run'}).",
            f"- Peak RSS per rank {_gib(f['peak_rss'])} "
            f"({'met' if rss_ok else 'missed'}, target ≤ 3 GiB).",
            f"- Step time / disk time of its bytes: {ratio_line}."]


def scale_section(results: dict) -> list[str]:
    lines = [HEADING, ""]
    if "run" not in results:
        return lines + ["Not run in this report."]
    m, t = results["size"]["model"], results["size"]["train"]
    params, f = param_count(m), figures(results)
    dd = _dd(results)
    dd_line = ("dd failed: " + str(results.get("dd_before", {}).get("error"))) if dd is None else (
        f"dd (direct I/O, {results['size']['dd_mib']} MiB, in the swap folder) before / after: "
        f"write {results['dd_before']['write'] / 1e6:,.0f} / {results['dd_after']['write'] / 1e6:,.0f}"
        f" MB/s, read {results['dd_before']['read'] / 1e6:,.0f} / "
        f"{results['dd_after']['read'] / 1e6:,.0f} MB/s")
    machine = results["machine"]
    opts = ", ".join(f"`{k.removeprefix('zero_optimization.')}: {v}`"
                     for k, v in SCALE_OPTIONS.items() if "nvme_path" not in k)
    lines += [
        f"moezero at W = 2 (gloo), {m['n_layers']} layers × {m['num_experts']} experts (dim "
        f"{m['dim']}, expert width {m['ffn_dim']}, top-{m['top_k']}, ep {m['ep_size']}: each "
        f"rank steps its own {m['num_experts'] // m['ep_size']} experts per layer), fp32, "
        f"{opts}; {params / 1e9:.2f} B parameters, training state (fp32 params, master, two "
        f"moments) {16 * params / GB:.1f} GB; on disk {12 * params / GB:.1f} GB of master and "
        f"moments (the fp32 params are read from the master's swap files) and "
        f"{4 * params / GB:.1f} GB of reduced gradients. Micro-batch {t['micro_batch_size']} × {t['seq_len']} tokens per "
        f"rank, {t['timed']} steps, then a save, a cold load into the same engine and one more "
        "step.", "",
        f"Measured {machine['date']} on {machine['cpu']} ({machine['cores']} cores, "
        f"{machine['mem_bytes'] / 2**30:.0f} GiB), torch {machine['torch']}. {dd_line}. "
        f"Ranks run with {_env(results)}.", "",
        *table(["system", "params", "peak RSS / rank", "peak anon / rank", "init", "step",
                "read / written per step (both ranks)", "step / disk time", "save", "load"],
               _rows(f, results, params)), "", *_verdicts(f, params, m["num_experts"])]
    if f is not None:
        lines += [
            f"- Steps: {', '.join(f'{s:.1f} s' for s in f['step_list'])}; losses "
            f"{', '.join(f'{v:.4f}' for v in f['losses'])}; after the load, one more step in "
            f"{f['resumed_s']:.1f} s (loss {f['resumed_loss']:.4f}).",
            "- Peak RSS by phase (larger rank; `VmHWM` restarted at each phase): "
            + ", ".join(f"{k} {_gib(v)}" for k, v in f["phases"].items()) + ".",
            f"- Bytes through the swap engine (AsyncIO) per step, both ranks: "
            f"{f['swap'] / GB:.1f} GB ({f['swap'] / params:.1f} B per parameter); checkpoint "
            f"{f['ckpt_bytes'] / GB:.1f} GB.",
            "- Disk time = bytes read / dd read + bytes written / dd write (the mean of before "
            "and after), from `/proc/self/io` of both ranks (one disk)."]
    if f is not None and "step_phases" in f:
        lines += ["", *phase_table({"moezero": {"phases": f["step_phases"]}})]
    peer = results.get("peer") or {}
    if peer.get("params"):
        z = (peer.get("config") or {}).get("zero_optimization", {})
        lines.append(f"- DeepSpeed row: `benchmarks/deepspeed_scale.py` (its own JSON, its own "
                     f"run and model of {peer['params'] / 1e9:.2f} B), kind `{peer.get('kind')}`, "
                     f"ZeRO stage {z.get('stage')}, params and optimizer on "
                     f"{(z.get('offload_param') or {}).get('device')}/"
                     f"{(z.get('offload_optimizer') or {}).get('device')}, DeepSpeed "
                     f"{(peer.get('versions') or {}).get('deepspeed')}.")
    return lines + ["", "Command (this table only): `"
                    + harness_command(results, "scale") + " --peer-json PATH --timeout 3600`"]
