"""Figures of one run and of one configuration, from raw worker results.

Per run: tokens/s per rank from the median step time after warm-up, peak RSS and peak
anonymous memory per rank (the larger rank), moezero's engine step peak and timed parts of
the step, checkpoint bytes, first and second save time and cold load time (the slower rank),
and the plain copies of NVMe swap files beside the saves (bytes summed over the ranks).
Per configuration: the median over its rounds.
"""

from __future__ import annotations

from statistics import median


def param_count(model: dict) -> int:
    """Parameters of the decoder (all experts counted once): the same for every system."""
    d, e = model["dim"], model["num_experts"]
    layer = 4 * d * d + 2 * d + d * e + e * 3 * d * model["ffn_dim"]
    return 2 * model["vocab_size"] * d + model["n_layers"] * layer + d


def run_stats(run: dict) -> dict:
    """One successful run's figures (see the module docstring)."""
    ranks = run["ranks"]
    step = [median(r["step_s"]) for r in ranks]
    rates = [r["tokens_per_step"] / s for r, s in zip(ranks, step, strict=True)]
    out = {"tokens_per_s": sum(rates) / len(rates),
           "step_ms": 1e3 * median(step),
           "step_call_ms": 1e3 * median(median(r["step_call_s"]) for r in ranks),
           "peak_rss": max(r["peak_rss"] for r in ranks),
           "anon_peak": max(r["anon_peak"] for r in ranks),
           "anon_growth": max(r["anon_peak"] - r["anon_start"] for r in ranks),
           "loss_first": ranks[0]["losses"][0], "loss_last": ranks[0]["losses"][-1],
           "opt_elements": ranks[0]["info"].get("optimizer_elements"),
           "dtype": ranks[0]["info"].get("dtype", "float32"),
           "stage": ranks[0]["info"].get("stage")}
    out.update(_trace_stats(ranks))
    out.update(_checkpoint_stats(ranks))
    return out


def _trace_stats(ranks: list[dict]) -> dict:
    """moezero's per-step figures: engine step peak (max over steps and ranks), persistent
    engine bytes, and the median timed-step ms of each timed part (median of the ranks)."""
    out = {}
    persistent = [r["info"].get("persistent_engine_bytes") for r in ranks]
    if all(p is not None for p in persistent):
        out["persistent"] = max(persistent)
    peaks = [p for r in ranks for p in r.get("trace", {}).get("engine_peak", []) if p is not None]
    if peaks:
        out["engine_peak"] = max(peaks)
    for key in ("optimizer_s", "adamw_s", "reduce_s"):
        timed = [r.get("trace", {}).get(key, [])[-len(r["step_s"]):] for r in ranks]
        if all(timed):
            out[key[:-2] + "_ms"] = 1e3 * median(median(t) for t in timed)
    return out


def _checkpoint_stats(ranks: list[dict]) -> dict:
    ckpt = ranks[0].get("checkpoint") or {}
    if "bytes" not in ckpt:
        return {"ckpt_note": ckpt.get("note", "not saved in this run")}
    out = {"ckpt_bytes": ckpt["bytes"], "ckpt_files": ckpt["files"]}
    for key in ("save_s", "second_save_s", "load_s"):
        if all(key in r["checkpoint"] for r in ranks):
            out[key] = max(r["checkpoint"][key] for r in ranks)
            out[key[:-2] + "_bw"] = ckpt["bytes"] / out[key]
    for key in ("save", "second_save"):  # vs rank 0's dd writes right before and after it
        if ckpt.get(key + "_dd") and out.get(key + "_bw"):
            out[key + "_of_dd"] = out[key + "_bw"] / ckpt[key + "_dd"]
    out["load_note"] = ckpt.get("load_note")
    out.update(_copy_stats(ranks))
    return out


def _copy_stats(ranks: list[dict]) -> dict:
    """The plain copy of the swap files after each save (``worker.plain_copy``): bytes summed
    over the ranks, time of the slower rank."""
    ckpts = [r["checkpoint"] for r in ranks]
    if any("copy_note" in c for c in ckpts):
        return {"copy_note": next(c["copy_note"] for c in ckpts if "copy_note" in c)}
    if not all("copy_s" in c for c in ckpts):
        return {}
    out = {"copy_bytes": sum(c["copy_bytes"] for c in ckpts),
           "copy_files": sum(c["copy_files"] for c in ckpts), "copy_method": ckpts[0]["copy_method"]}
    for key in ("copy_s", "second_copy_s"):
        if all(key in c for c in ckpts):
            out[key] = max(c[key] for c in ckpts)
            out[key[:-2] + "_bw"] = out["copy_bytes"] / out[key]
    return out


def config_stats(runs: list[dict]) -> dict:
    """Median of each figure over a configuration's successful rounds, or its failure."""
    ok = [run_stats(r) for r in runs if r["status"] == "ok"]
    if not ok:
        bad = runs[0]
        reason = bad.get("error") or bad["ranks"][0].get("note", "")
        label = "not supported yet" if bad["status"] == "unsupported" else "failed"
        return {"status": label, "reason": reason, "runs": 0}
    keys = [k for k in ok[0] if isinstance(ok[0][k], (int, float))]
    stats = {k: median(s[k] for s in ok) for k in keys if all(s.get(k) is not None for s in ok)}
    rates = [s["tokens_per_s"] for s in ok]
    stats.update(status="ok", runs=len(ok), ckpt_note=ok[0].get("ckpt_note"),
                 load_note=ok[0].get("load_note"), copy_note=ok[0].get("copy_note"),
                 copy_method=ok[0].get("copy_method"), dtype=ok[0]["dtype"],
                 system=runs[0]["spec"]["system"],
                 tokens_per_s_range=(min(rates), max(rates)))
    return stats


def limits(results: dict) -> dict:
    """Medians over the rounds of dd write/read and memory copy bandwidth (bytes/s)."""
    dd = [r["dd"] for r in results["limits"]]
    errors = [d["error"] for d in dd if "error" in d]
    out = {"memcpy": median(r["memcpy"] for r in results["limits"]), "rounds": len(dd)}
    if dd and not errors:
        out.update(dd_write=median(d["write"] for d in dd), dd_read=median(d["read"] for d in dd))
        if all("write_buffered" in d for d in dd):
            out["dd_write_buffered"] = median(d["write_buffered"] for d in dd)
    else:
        out["dd_error"] = errors[0] if errors else "not measured"
    return out


def by_name(results: dict, series: str = "main") -> dict[str, dict]:
    """Configuration name -> stats over its rounds in ``series``, in the order they ran."""
    runs = [r for r in results["runs"] if r["spec"]["series"] == series]
    names = dict.fromkeys(r["spec"]["name"] for r in runs)
    return {n: config_stats([r for r in runs if r["spec"]["name"] == n]) for n in names}


def point(results: dict, series: str, name: str, *, experts: int | None = None,
          world: int | None = None) -> dict | None:
    """Stats of the runs of ``name`` in ``series`` at the given experts and world size
    (None: any), or None when there are none."""
    runs = [r for r in results["runs"] if r["spec"]["series"] == series
            and r["spec"]["name"] == name
            and experts in (None, r["spec"]["model"]["num_experts"])
            and world in (None, r["spec"].get("world_size", 2))]
    return config_stats(runs) if runs else None
