"""Figures of one run and of one configuration, from raw worker results.

Per run: tokens/s per rank from the median step time after warm-up, peak RSS and peak
anonymous memory per rank (the larger rank), checkpoint bytes and save time. Per configuration: the median over its rounds.
"""

from __future__ import annotations

from statistics import median

from benchmarks.specs import MOEZERO_CONFIGS, PEER_CONFIGS


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
           "opt_elements": ranks[0]["info"].get("optimizer_elements")}
    ckpt = ranks[0].get("checkpoint") or {}
    if "bytes" in ckpt:
        save_s = max(r["checkpoint"]["save_s"] for r in ranks)
        out.update(ckpt_bytes=ckpt["bytes"], ckpt_files=ckpt["files"], save_s=save_s,
                   save_bw=ckpt["bytes"] / save_s)
    else:
        out["ckpt_note"] = ckpt.get("note", "not saved in this run")
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
                 tokens_per_s_range=(min(rates), max(rates)))
    return stats


def limits(results: dict) -> dict:
    """Medians over the rounds of dd write/read and memory copy bandwidth (bytes/s)."""
    dd = [r["dd"] for r in results["limits"]]
    errors = [d["error"] for d in dd if "error" in d]
    out = {"memcpy": median(r["memcpy"] for r in results["limits"]), "rounds": len(dd)}
    if dd and not errors:
        out.update(dd_write=median(d["write"] for d in dd), dd_read=median(d["read"] for d in dd))
    else:
        out["dd_error"] = errors[0] if errors else "not measured"
    return out


def by_name(results: dict, series: str = "main") -> dict[str, dict]:
    """Configuration name -> stats, in the order of the spec lists."""
    names = [n for n, _ in MOEZERO_CONFIGS] + [n for n, _, _ in PEER_CONFIGS]
    runs = [r for r in results["runs"] if r["spec"]["series"] == series]
    return {n: config_stats([r for r in runs if r["spec"]["name"] == n])
            for n in names if any(r["spec"]["name"] == n for r in runs)}
