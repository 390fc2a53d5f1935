"""Report sections about bandwidth limits: checkpoint save/load against dd, the optimizer step
against memory bandwidth, and NVMe swap throughput. Every figure comes from ``results.json``."""

from __future__ import annotations

from benchmarks.fmt import commands, mbs, ok, table, verdict, why_not
from benchmarks.machine import DD_BESIDE_MIB
from benchmarks.specs import NVME_CONFIG
from benchmarks.stats import by_name

SAVE_TARGET = 0.8
FSDP2, MOEZERO = "FSDP2 + DCP", "moezero stage 2"


# ----------------------------------------------------------------------------- C: checkpoints


def save_vs_dd(s: dict, key: str, lim: dict) -> tuple[float | None, str]:
    """Save ``key``'s bandwidth as a fraction of a dd write, and which dd: the median over
    rounds of each save's ratio to the mean of the dd writes right before and right after it
    (``worker._dd_beside``), else (a dd beside it failed) its bandwidth over the run's dd."""
    if s.get(key[:-2] + "_of_dd") is not None:
        return s[key[:-2] + "_of_dd"], "of dd"
    if s.get(key[:-2] + "_bw") and lim.get("dd_write"):
        return s[key[:-2] + "_bw"] / lim["dd_write"], "of the run's dd"
    return None, ""


def _io_cell(s: dict, key: str, vs: tuple[float | None, str],
             buffered: float | None = None) -> str:
    if s.get(key) is None:
        return (s.get("load_note") or "–") if key == "load_s" else "–"
    bw = s[key[:-2] + "_bw"]
    frac, what = vs
    text = f" · {100 * frac:.0f}% {what}" if frac is not None else ""
    text += f" ({100 * bw / buffered:.0f}% of buffered dd)" if buffered else ""
    return f"{s[key]:.2f} s · {mbs(bw)}{text}"


def _ckpt_rows(stats: dict, label: str, lim: dict) -> list[list]:
    rows = []
    for name in (MOEZERO, FSDP2):
        s = stats.get(name)
        if not ok(s) or s.get("ckpt_bytes") is None:
            rows.append([label, name, why_not(s) if not ok(s) else s.get("ckpt_note")] + ["–"] * 3)
            continue
        rows.append([label, name, f"{s['ckpt_bytes']:,.0f}",
                     _io_cell(s, "save_s", save_vs_dd(s, "save_s", lim),
                              lim.get("dd_write_buffered")),
                     _io_cell(s, "second_save_s", save_vs_dd(s, "second_save_s", lim),
                              lim.get("dd_write_buffered")),
                     _io_cell(s, "load_s", (s["load_bw"] / lim["dd_read"], "of dd")
                              if s.get("load_bw") and lim.get("dd_read") else (None, ""))])
    return rows


def _save_targets(large: dict, small: dict, lim: dict) -> list[list]:
    rows = []
    for label, stats in (("large", large), ("small", small)):
        s = stats.get(MOEZERO)
        for key, which in (("second_save_s", "second save"), ("save_s", "first save")):
            frac, what = save_vs_dd(s, key, lim) if ok(s) else (None, "")
            if frac is None:
                rows.append([f"save ≥ 80% of dd write ({label}, {which})", "not measured", "–"])
                continue
            rows.append([f"save ≥ 80% of dd write ({label} checkpoint, {which})",
                         f"{100 * frac:.0f}% {what} write", verdict(frac, SAVE_TARGET, ">=")])
    return rows


def _dcp_targets(large: dict) -> list[list]:
    moe, peer = large.get(MOEZERO), large.get(FSDP2)
    rows = []
    for key, what in (("ckpt_bytes", "bytes on disk"), ("second_save_s", "save time (second)"),
                      ("save_s", "save time (first)"), ("load_s", "cold load time")):
        if ok(moe) and ok(peer) and moe.get(key) and peer.get(key):
            ratio = moe[key] / peer[key]
            rows.append([f"{what} ≤ DCP's (large)", f"{ratio:.2f}× of DCP",
                         verdict(ratio, 1.0, "<=")])
        else:
            rows.append([f"{what} ≤ DCP's (large)", "not measured", "–"])
    return rows


def _fixed_cost(large: dict | None, small: dict | None) -> list[str]:
    """The small save's time beyond its bytes at the large save's bandwidth (second saves)."""
    if not (ok(large) and ok(small) and large.get("second_save_bw") and small.get("second_save_s")):
        return []
    fixed = small["second_save_s"] - small["ckpt_bytes"] / large["second_save_bw"]
    return ["", f"moezero's fixed cost per save, estimated: {fixed:.2f} s = small second save "
            f"({small['second_save_s']:.2f} s) − its {small['ckpt_bytes'] / 1e6:.0f} MB at the "
            f"large second save's {mbs(large['second_save_bw'])}."]


def _first_vs_second(large: dict, small: dict) -> list[str]:
    """First save time / second save time of every saved row (> 1: the first is slower)."""
    cells = [f"{name} {label} {s['save_s'] / s['second_save_s']:.2f}×"
             for label, stats in (("large", large), ("small", small))
             for name, s in stats.items()
             if name in (MOEZERO, FSDP2) and ok(s) and s.get("second_save_s")]
    return [f"- First save time / second save time in one process: {', '.join(cells)}."] \
        if cells else []


def ckpt_section(results: dict, lim: dict) -> list[str]:
    large, small = by_name(results, "ckpt"), by_name(results, "main")
    lines = ["## Checkpoint save and load against dd (issues 6 and 8)", ""]
    if not large:
        return lines + ["Not run in this report."]
    m = results["size"]["ckpt_model"]
    rows = _ckpt_rows(large, "large", lim) + _ckpt_rows(small, "small (main model)", lim)
    lines += table(["checkpoint", "system", "bytes", "first save in the process",
                    "second save", "cold load"], rows)
    lines += ["", *table(["target", "measured", "status"],
                         _save_targets(large, small, lim) + _dcp_targets(large))]
    return lines + [*_fixed_cost(large.get(MOEZERO), small.get(MOEZERO)),
        "", f"- large: dim {m['dim']}, {m['n_layers']} layers, {m['num_experts']} experts of "
        f"width {m['ffn_dim']}, trained {results['size']['ckpt_train']['timed']} step, then "
        "saved twice in the same process (each into a fresh folder) and the second copy loaded "
        "after its files were flushed and dropped from the page cache "
        "(`posix_fadvise(DONTNEED)`): a cold read. small: the main runs' checkpoint "
        "(median over rounds). Times from a barrier before to a barrier after, slower rank; "
        "bandwidth = bytes on disk / time; % of dd: the save's bandwidth over the mean of two "
        f"`oflag=direct` dd writes of {DD_BESIDE_MIB} MiB into the same folder, one right "
        "before and one right after that save (untimed, the file removed and synced before "
        "the save starts; the disk's speed drifts by tens of percent between minutes on this "
        "VM, so a save is compared with the disk of its own moment), median over rounds; "
        "'of the run's dd' where a dd beside it failed; loads "
        "against this run's `iflag=direct` dd read; buffered dd = this run's `conv=fsync` "
        "write (through the page cache, flushed).",
        "- moezero writes the 4 KiB-aligned bulk of each range with O_DIRECT (the "
        "`offload.AsyncIO` engine, 16 MiB staging buffers) and the unaligned ends and ranges "
        "under 512 KiB through the page cache, then flushes once (one `syncfs` per rank); DCP "
        "writes through the page cache and fsyncs each file. "
        "Both save from 2 ranks at once; the 80% target is judged against the O_DIRECT dd line, "
        "as issue 8 states it.",
        "- The small checkpoint is dominated by fixed costs (file creation, the flush, "
        "manifest, commit, the collectives of the protocol), so its bandwidth is far from "
        "dd's; the large one is bandwidth-bound.",
        *_first_vs_second(large, small),
        "- moezero writes each rank's fp32 partitions (master, exp_avg, exp_avg_sq) into "
        "safetensors files; FSDP2 saves model + optimizer state with "
        "`torch.distributed.checkpoint` (`dcp.save` / `dcp.load` + `set_state_dict`).", "",
        *commands(results, "ckpt")]


# ----------------------------------------------------------------------------- NVMe state vs copy


def _rate_cell(seconds: float | None, nbytes: float | None, limit: float | None,
               what: str = "dd write") -> str:
    if seconds is None or not nbytes:
        return "–"
    frac = f" · {100 * nbytes / seconds / limit:.0f}% of {what}" if limit else ""
    return f"{seconds:.2f} s · {mbs(nbytes / seconds)}{frac}"


def _nvme_rows(stats: dict, lim: dict) -> list[list]:
    """Per configuration, a row per save: its time, the plain copy after it, the ratio; the
    cold load on the second save's row (the checkpoint it loads)."""
    rows = []
    for name in (MOEZERO, NVME_CONFIG):
        s = stats.get(name)
        if not ok(s) or s.get("ckpt_bytes") is None:
            rows.append([name, "–", why_not(s) if not ok(s) else s.get("ckpt_note")] + ["–"] * 5)
            continue
        copies = s.get("copy_s") is not None
        for which, save, copy in (("first" + (" (copy right after)" if copies else ""),
                                   "save_s", "copy_s"),
                                  ("second" + (" (copy right before)" if copies else ""),
                                   "second_save_s", "second_copy_s")):
            save_s, copy_s, nbytes = s.get(save), s.get(copy), s.get("copy_bytes")
            cells = [s.get("copy_note") or "– (state in memory)", "–", "–"]
            if copy_s is not None and nbytes:
                cells = [f"{nbytes:,.0f} ({s['copy_files']:.0f} files)",
                         _rate_cell(copy_s, nbytes, lim.get("dd_write")), "–"]
                if save_s is not None:
                    per_byte = save_s * nbytes / (copy_s * s["ckpt_bytes"])
                    cells[2] = f"{save_s / copy_s:.2f}× (per byte {per_byte:.2f}×)"
            load = ""
            if save == "second_save_s":
                load = (_rate_cell(s["load_s"], s["ckpt_bytes"], lim.get("dd_read"), "dd read")
                        if s.get("load_s") is not None else s.get("load_note") or "–")
            rows.append([name, which, f"{s['ckpt_bytes']:,.0f}",
                         _io_cell(s, save, save_vs_dd(s, save, lim)), *cells, load])
    return rows


def _abba_line(s: dict | None) -> list[str]:
    """Both saves against both copies of the NVMe row (the drift-free ratio of the ABBA)."""
    keys = ("save_s", "second_save_s", "copy_s", "second_copy_s")
    if not ok(s) or any(s.get(k) is None for k in keys):
        return []
    saves, copies = s["save_s"] + s["second_save_s"], s["copy_s"] + s["second_copy_s"]
    return [f"{NVME_CONFIG}, both saves / both copies: {saves:.2f} s / {copies:.2f} s = "
            f"**{saves / copies:.2f}×** the time of a plain copy (per byte "
            f"{saves * s['copy_bytes'] / (copies * s['ckpt_bytes']):.2f}×).", ""]


def nvme_ckpt_section(results: dict, lim: dict) -> list[str]:
    """Checkpoint of NVMe-resident optimizer state against a plain copy of its swap files."""
    stats = by_name(results, "ckpt")
    lines = ["## Checkpoint of NVMe-resident state vs a plain copy of the same bytes (issue 7)", ""]
    if NVME_CONFIG not in stats:
        return lines + ["Not run in this report."]
    method = stats[NVME_CONFIG].get("copy_method") or "sendfile"
    m = results["size"]["ckpt_model"]
    return lines + [
        *table(["configuration", "save", "checkpoint bytes", "save time", "plain-copy bytes",
                "plain-copy time", "save / copy time", "cold load (of the second save)"],
               _nvme_rows(stats, lim)), "", *_abba_line(stats.get(NVME_CONFIG)),
        f"- The large checkpoint model (dim {m['dim']}, {m['n_layers']} layers, "
        f"{m['num_experts']} experts of width {m['ffn_dim']}), W = 2, 1 training step, then "
        "in the same processes: save, plain copy, plain copy, second save (ABBA, so a drift "
        "of the disk's speed during the sequence, which repeated writes of a few hundred MB "
        "show on this VM, weighs on saves and copies alike), cold load. "
        f"{NVME_CONFIG}: ZeRO-3 with `offload_optimizer.device=nvme` and "
        "`offload_param.device=nvme`, swap files under `bench_out/nvme` (the checkpoint "
        "folder's filesystem); stage 2 keeps its state in memory (reference row, no copy). "
        "Times from a barrier before to a barrier after, slower rank; % of dd = (bytes / time) "
        "/ dd: for a save the dd writes right before and after it (as in the section above), for "
        "a plain copy this run's `oflag=direct` dd write, for the load its `iflag=direct` dd "
        "read.",
        "- Before each save and each copy every rank fsyncs its optimizer swap files and drops "
        "them from the page cache (`posix_fadvise(DONTNEED)`, untimed), so both read them "
        "from the disk.",
        "- Save time: rank 0 creates `step_XXXXXXXX.partial/` and writes every file's "
        "safetensors header; the ranks agree (gloo); each rank copies the real elements of "
        "each state of each group from its swap files into the checkpoint files with "
        "`os.copy_file_range` in 8 MiB chunks, reading each chunk back (page cache) for its "
        "crc32, then flushes them (one `syncfs` of the filesystem); the range records and RNG "
        "states are gathered; rank 0 writes the manifest (temporary file, fsync, rename), "
        "fsyncs the folder, renames `.partial` to the step folder and updates `latest`. The "
        "stage-2 row "
        "writes its in-memory partitions (crc32 of the bytes in memory) instead of copying.",
        "- Plain-copy time: each rank `shutil.copyfile`s its optimizer swap files (master, "
        "exp_avg, exp_avg_sq of every local group: the rank's partitions, padding included, "
        f"rounded up to 4096 B), whole, into a fresh folder next to the checkpoint ({method} in "
        "the kernel), then fsyncs each copy; no header, checksum, manifest, folder fsync or "
        "rename. The copies are deleted with the checkpoints, after the load.",
        "- Bytes: checkpoint = every file of the step folder and `latest` (both ranks' "
        "partitions without padding, headers, manifest); plain copy = both ranks' swap files. "
        "Per byte = (save time / checkpoint bytes) / (copy time / copy bytes).",
        "- Cold load: the second checkpoint, flushed and dropped from the page cache, loaded "
        "into the same configuration: each group's shard read into a host buffer and written "
        "to its swap file, then the params derived from the masters (param swap files "
        "written).", "",
        *commands(results, "ckpt")]


# ----------------------------------------------------------------------------- D: optimizer step


def bytes_per_element(s: dict) -> int:
    """Bytes an AdamW step must move per local element (see ``NOTES_OPT``)."""
    c = 2 if s.get("dtype") in ("bfloat16", "float16") else 4
    if s.get("system") != "moezero":
        return 28  # torch AdamW on the fp32 parameter itself: grad 4 + param/m/v r+w 24
    master_is_param = s.get("stage") == 0 and c == 4
    return 24 + c + (0 if master_is_param else c)


def _opt_row(series: str, name: str, s: dict, memcpy: float) -> list | None:
    measured = s.get("optimizer_ms") or s.get("step_call_ms")
    if not ok(s) or not s.get("opt_elements") or not measured:
        return None
    per = bytes_per_element(s)
    bound = 1e3 * per * s["opt_elements"] / memcpy
    adamw = f"{s['adamw_ms']:.1f}" if s.get("adamw_ms") else "–"
    opt = f"{s['optimizer_ms']:.1f}" if s.get("optimizer_ms") else "–"
    return [f"{name} ({series})", s.get("dtype", "float32"), f"{s['opt_elements']:,.0f}", per,
            f"{bound:.2f}", adamw, opt, f"{s['step_call_ms']:.1f}",
            f"{100 * bound / measured:.0f}%",
            f"{100 * bound / s['adamw_ms']:.0f}%" if s.get("adamw_ms") else "–"]


def optimizer_section(results: dict, lim: dict) -> list[str]:
    rows = [row for series in ("main", "tiled", "ckpt")
            for name, s in by_name(results, series).items()
            if (row := _opt_row(series, name, s, lim["memcpy"]))]
    return ["## Optimizer step against memory bandwidth (issue 8)", "",
            *table(["configuration (series)", "dtype", "elements stepped per rank",
                    "bytes / element", "bound ms (bytes at memcpy bandwidth)", "adamw_ ms",
                    "optimizer_step() ms", "step() ms", "bound / optimizer_step()",
                    "bound / adamw_"], rows),
            "", *NOTES_OPT, "", *commands(results, ("main", "tiled", "ckpt"))]


NOTES_OPT = [
    "- Bytes per element of the local partition, the least an AdamW step can move: read the "
    "gradient (c = 4 B fp32, 2 B bf16), read + write the fp32 master (8), exp_avg (8) and "
    "exp_avg_sq (8), write the compute-dtype parameter (c): 24 + 2c = 32 B in fp32 and 28 B in "
    "bf16 for moezero stages 1–2 (the downcast writes the all-gather's source, in fp32 too, "
    "where the master is the params' own range); 28 B at stage 0 in fp32 and for "
    "FSDP2/DeepSpeed rows (the fp32 parameter is the master, nothing else to write). Bound = "
    "bytes × elements / the measured memory-copy bandwidth (which counts read + write bytes).",
    "- adamw_: the update math alone (`moezero.zero.hostadam.adamw_step_`, summed over groups); "
    "optimizer_step(): moezero's `engine.optimizer_step()` — grad norm (one all-reduce), "
    "upcast, clip, AdamW, downcast and, at stages 1–2, the parameter all-gather; step(): "
    "`reduce_gradients()` + `optimizer_step()` for moezero, `optimizer.step()` for FSDP2, "
    "`engine.step()` for DeepSpeed. The last column uses optimizer_step() (step() for peers).",
]


# ----------------------------------------------------------------------------- swap


def swap_section(results: dict) -> list[str]:
    swap = results.get("swap") or {"error": "not measured in this run"}
    lines = ["## NVMe swap throughput (AsyncIO vs dd)", ""]
    if "error" in swap:
        return lines + table(["measurement", "status"], [["swap files", swap["error"]]])
    rows = [[op, f"{swap['moezero'][op]:,.0f} MB/s", f"{swap['dd'][op]:,.0f} MB/s",
             f"{swap['ratio'][op]:.2f}×"] for op in ("write", "read")]
    return lines + [*table(["operation", "moezero AsyncIO", "dd", "AsyncIO / dd"], rows), "",
                    f"`benchmarks/swap.py: swap_throughput`: {swap.get('nbytes', 0):,} bytes, "
                    f"median of {swap.get('repeats')} rounds, {swap.get('workers')} workers, "
                    f"O_DIRECT {'used' if swap.get('o_direct') else 'not available'}; writes "
                    "fsynced. Command: `python -m benchmarks.swap bench_out --mib "
                    f"{swap.get('mib', 256)} --repeats {swap.get('repeats')}`."]
