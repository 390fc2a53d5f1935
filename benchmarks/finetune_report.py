"""The ``finetune`` series' figures and BENCHMARKS.md section, from its raw results
(``benchmarks.finetune``). Pure: nothing here runs a model."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from benchmarks.fmt import mib, table, verdict

SECTION = ("## Fine-tuning: moezero LoRA and full SFT vs TRL SFTTrainer + PEFT + DeepSpeed "
           "ZeRO-3 (issue 26)")
TARGETS = {"speed": 1.5, "memory": 0.7, "ckpt": 1.1}
PEER_KEY = "TRL"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def longest_document(folder: Path) -> int:
    """Tokens of the longest document of a prepared dataset (``documents.npy`` offsets)."""
    import numpy as np

    return int(np.diff(np.load(Path(folder) / "documents.npy")).max())


def adapter_params(model: dict, r: int) -> int:
    """LoRA parameters of moezero's ``peft.targets: [attn, experts]`` on ``model``, from the
    shapes: each adapted ``[out, in]`` weight gets A ``[r, in]`` and B ``[out, r]``. Attention:
    wq ``[H·hd, D]``, wk and wv ``[KV·hd, D]``, wo ``[D, H·hd]``; every routed expert: w1 and w3
    ``[F, D]``, w2 ``[D, F]``."""
    dim, ffn = model["dim"], model["ffn_dim"]
    head = dim // model["n_heads"]
    q, kv = model["n_heads"] * head, model["n_kv_heads"] * head
    attn = r * ((dim + q) + 2 * (dim + kv) + (q + dim))
    experts = model["num_experts"] * 3 * r * (dim + ffn)
    return model["n_layers"] * (attn + experts)


def attempts(run: dict) -> list[dict]:
    """A row's runs: its ``repeats``, or the row itself (a result of one run per row)."""
    return run["repeats"] if "repeats" in run else [run]


def failure(run: dict) -> str | None:
    """The error of a row's first failed run when none succeeded, else None."""
    runs = attempts(run)
    if any(r["status"] == "ok" for r in runs):
        return None
    return runs[0]["error"]


def _failed(run: dict) -> list[str]:
    return [r["error"] for r in attempts(run) if r["status"] != "ok"]


def _one_stats(run: dict) -> dict:
    ranks = run["ranks"]

    def per_rank(key: str) -> float:
        return statistics.mean(sum(r[key]) / sum(r["step_s"]) for r in ranks)

    ckpt = ranks[0]["checkpoint"]
    return {"trained_per_s": per_rank("trained"), "seen_per_s": per_rank("seen"),
            "step_s": statistics.median(s for r in ranks for s in r["step_s"]),
            "anon_peak": max(r["anon_peak"] for r in ranks),
            "peak_rss": max(r["peak_rss"] for r in ranks),
            "ckpt_bytes": ckpt["bytes"], "ckpt_files": ckpt["files"],
            "save_s": max(r["checkpoint"]["save_s"] for r in ranks),
            "loss": (ranks[0]["losses"][0], ranks[0]["losses"][-1])}


def row_stats(run: dict) -> dict:
    """Per-rank throughput (each rank's tokens over its timed steps' time, averaged over the
    ranks), the larger rank's peaks, the checkpoint and the loss of a successful row; over
    repeats: the median throughput and step time, the largest peaks, the first's loss and
    checkpoint, each repeat's trained tokens/s (``each``), of the runs that succeeded, and
    the errors of those that failed (``failed``)."""
    each = [_one_stats(r) for r in attempts(run) if r["status"] == "ok"]
    merged = {**each[0], "each": [e["trained_per_s"] for e in each], "failed": _failed(run)}
    for key in ("trained_per_s", "seen_per_s", "step_s"):
        merged[key] = statistics.median(e[key] for e in each)
    for key in ("anon_peak", "peak_rss", "save_s"):
        merged[key] = max(e[key] for e in each)
    return merged


def progress(run: dict) -> str:
    """One console line for a finished row."""
    if run["status"] != "ok":
        return f"failed: {run['error']}"
    s = row_stats(run)
    return (f"{s['trained_per_s']:,.0f} trained tokens/s per rank, peak anon "
            f"{mib(s['anon_peak'])} [{run['wall_s']:.0f} s]")


def family_runs(results: dict) -> dict[str, dict]:
    """Family key -> its runs, params and paths (a result from before the families: its
    ``runs`` as Qwen3-MoE's)."""
    data = results["finetune"]
    if "families" in data:
        return data["families"]
    return {"qwen3_moe": {"runs": data["runs"], "params": data["inputs"]["params"]}}


def stats_of(runs: dict) -> dict[str, dict | None]:
    return {name: None if failure(run) else row_stats(run) for name, run in runs.items()}


def fastest_lora(stats: dict) -> str | None:
    """The moezero LoRA row with the most trained tokens/s (the one the targets use)."""
    lora = [n for n, s in stats.items() if s and n.startswith("moezero LoRA")]
    return max(lora, key=lambda n: stats[n]["trained_per_s"], default=None)


def peer_of(stats: dict) -> tuple[str, dict | None]:
    name = next(n for n in stats if n.startswith(PEER_KEY))
    return name, stats[name]


def target_rows(results: dict) -> list[list[str]]:
    """The issue's three targets: measured ratio and verdict (or why not measured)."""
    stats = stats_of(family_runs(results)["qwen3_moe"]["runs"])
    mine, (peer_name, peer) = fastest_lora(stats), peer_of(stats)
    data = results["finetune"]
    train = data["size"]["train"]
    params = adapter_params(data["size"]["model"], train["r"])
    labels = (f"moezero LoRA ≥ {TARGETS['speed']}× the peer's trained tokens/s per rank",
              f"moezero LoRA ≤ {TARGETS['memory']}× the peer's peak memory (anon) per rank",
              f"LoRA checkpoint ≤ {TARGETS['ckpt']}× adapter params × 12 B "
              f"({params:,} params: {12 * params:,} B)")
    if mine is None:
        return [[label, "–", "not measured: no moezero LoRA row ran"] for label in labels]
    m = stats[mine]
    rows = []
    for label, key, need, kind in ((labels[0], "trained_per_s", TARGETS["speed"], ">="),
                                   (labels[1], "anon_peak", TARGETS["memory"], "<=")):
        if peer is None:
            rows.append([label, "–", f"not measured: {peer_name} failed"])
            continue
        ratio = m[key] / peer[key]
        rows.append([label, f"{ratio:.2f}× ({mine})", verdict(ratio, need, kind)])
    ratio = m["ckpt_bytes"] / (12 * params)
    rows.append([labels[2], f"{ratio:.3f}× ({m['ckpt_bytes']:,} B)",
                 verdict(ratio, TARGETS["ckpt"], "<=")])
    return rows


def tokens_cell(s: dict) -> str:
    """Trained tokens/s per rank: the median, and each repeat's when there are several."""
    each = " / ".join(f"{x:,.0f}" for x in s["each"])
    text = f"{s['trained_per_s']:,.0f}" + (f" ({each})" if len(s["each"]) > 1 else "")
    if s.get("failed"):
        text += f"; {len(s['failed'])} more run(s) failed: {s['failed'][0]}"
    return text


def _row(name: str, s: dict | None, run: dict) -> list:
    if s is None:
        return [name, f"failed: {failure(run)}", *["–"] * 7]
    return [name, tokens_cell(s), f"{s['seen_per_s']:,.0f}",
            f"{s['step_s']:.2f}", mib(s["peak_rss"]), mib(s["anon_peak"]),
            f"{s['ckpt_bytes']:,} ({s['ckpt_files']} files)", f"{s['save_s']:.2f}",
            f"{s['loss'][0]:.3f} → {s['loss'][1]:.3f}"]


def _counts(results: dict) -> str:
    """The trained-token agreement line: moezero's prepared manifest vs the peer's dataset."""
    inputs, runs = results["finetune"]["inputs"], family_runs(results)
    peer = next((r for fam in runs.values() for n, r in fam["runs"].items()
                 if n.startswith(PEER_KEY) and not failure(r)), None)
    if peer is None:
        return f"moezero's prepared data: {inputs['tokens']:,} tokens, {inputs['trained']:,} trained."
    ds = next(r for r in attempts(peer) if r["status"] == "ok")["ranks"][0]["dataset"]
    same = "the same" if (ds["tokens"], ds["trained"]) == (inputs["tokens"], inputs["trained"]) \
        else "**different**"
    return (f"Whole data set: moezero's prepared manifest {inputs['tokens']:,} tokens, "
            f"{inputs['trained']:,} trained; TRL's tokenized and packed dataset "
            f"{ds['tokens']:,} tokens, {ds['trained']:,} trained ({ds['rows']} packed rows): "
            f"{same} counts.")


def _load(pair) -> str:
    return " ".join(f"{x:.2f}" for x in pair)


def run_line(results: dict) -> str:
    """The command, date and the machine's load around the run (``uptime`` when recorded)."""
    if "uptime_before" in results:
        load = (f"`uptime` before: {results['uptime_before']}; after: "
                f"{results['uptime_after']}")
    else:
        load = (f"load average {_load(results['load_before'])} before, "
                f"{_load(results['load_after'])} after")
    return f"Run: `{results['command']}` ({results['machine']['date']}; {load})."


def repeats_note(runs: dict) -> str:
    count = max(len(attempts(r)) for r in runs.values())
    return (f", each row run {count} times, interleaved (every row once, then again): the "
            "median throughput, the largest peak" if count > 1 else "")


def section(results: dict) -> list[str]:
    """The BENCHMARKS.md section of ``results["finetune"]``."""
    data, runs = results["finetune"], family_runs(results)["qwen3_moe"]["runs"]
    stats = stats_of(runs)
    size, inputs = data["size"], data["inputs"]
    train, model = size["train"], size["model"]
    body = [_row(name, stats[name], run) for name, run in runs.items()]
    peer_run = next(r for n, r in runs.items() if n.startswith(PEER_KEY))
    ok = [r for r in attempts(peer_run) if r["status"] == "ok"]
    trainable = f"{ok[0]['ranks'][0]['trainable_numel']:,}" if ok else "–"
    return [SECTION, "",
            f"A random `Qwen3MoeForCausalLM` ({inputs['params']:,} params: dim {model['dim']}, "
            f"{model['n_layers']} layers, {model['n_heads']} heads / {model['n_kv_heads']} KV, "
            f"{model['num_experts']} experts of width {model['ffn_dim']}, top-{model['top_k']}, "
            f"vocabulary {inputs['vocab']}) saved as an HF folder, `moezero import-hf`-ed; "
            f"{inputs['documents']} synthetic chats (longest {inputs['longest']} tokens) through "
            "one ChatML template with `{% generation %}` markers, `moezero prepare-data --format "
            "chat` for moezero and TRL's own tokenization for the peer, assistant tokens "
            f"trained. W = 2 (gloo, one thread per rank), seq len {train['seq_len']}, "
            f"micro-batch {train['micro_batch_size']} per rank, fp32, AdamW lr {train['lr']:g} "
            f"constant, betas 0.9/0.999, no decay, clip 1.0; {train['warmup']} warm-up + "
            f"{train['timed']} timed steps{repeats_note(runs)}. LoRA r {train['r']}, alpha "
            f"{train['alpha']} on "
            f"attention (q/k/v/o) and every expert: moezero "
            f"{adapter_params(model, train['r']):,} adapter params (w1, w3, w2 each r "
            f"{train['r']}), PEFT {trainable} (`target_parameters` on the fused "
            "`gate_up_proj` and `down_proj`: one r-rank adapter for gate and up together).", "",
            _counts(results), "",
            *table(["row", "trained tokens/s per rank", "seen tokens/s per rank",
                    "median step s", "peak RSS per rank", "peak anon per rank",
                    "checkpoint bytes", "save s", "loss first → last"], body), "",
            *table(["target", "measured", "verdict"], target_rows(results)), "",
            f"The targets use the fastest moezero LoRA row ({fastest_lora(stats) or 'none'}). "
            + run_line(results), "",
            *_notes()]


def _notes() -> list[str]:
    return [
        "- Packing, both sides: moezero packs conversations into rows of seq len + 1 with "
        "`data.document_mask` (each conversation attends to itself, positions restart); TRL "
        "packs with BFD (`packing=True`: whole conversations into bins of seq len, none cut, "
        "none longer than a bin here) padding-free (a micro-batch is one flattened row with "
        "per-conversation positions, masked per conversation by transformers' SDPA mask). "
        "Why this is fair: on both sides every token attends to exactly the earlier tokens of "
        "its own conversation and the same tokens are trained (the counts above); only how "
        "rows are filled differs. Tokens per step therefore differ (TRL's bins are not full); "
        "each row's tokens/s counts its own batches: seen = tokens through the model, trained "
        "= targets the loss takes.",
        "- Step time: moezero `engine.train_step` (forward, backward, reduction, step); TRL from "
        "`on_step_begin` to `on_step_end` (the same, plus TRL's per-step token accuracy and "
        "entropy metrics). Peak memory: `VmHWM` and resident anonymous memory sampled every "
        "10 ms in each rank from before the model is built (`benchmarks.common.AnonPeak`).",
        "- moezero's checkpoint (`engine.save_checkpoint`): LoRA rows hold the adapters and their "
        "AdamW moments (fp32 master + 2 moments: 12 B/param) plus the base's path and manifest "
        "hash; full SFT holds every weight and its moments. The peer's is what `save_strategy` "
        "writes (`Trainer._save_checkpoint`): `adapter_model.safetensors`, DeepSpeed's ZeRO-3 "
        "model and optimizer partitions (`global_stepN/`, pickles), scheduler, RNG, trainer "
        "state, tokenizer and DeepSpeed's conversion scripts.",
        "- The loss is the training loss of rank 0 (cross-entropy + router loss, coefficient "
        "0.001 on both sides) at the first and last step; the steps see different batches on "
        "each side (different packing and order), so losses compare only roughly.",
    ]
