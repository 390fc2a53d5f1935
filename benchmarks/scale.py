"""The ``scale`` series (issue 16): an MoE larger than the machine's memory, trained from swap.

``python -m benchmarks.run --series scale [--quick] [--peer-json PATH]``

One moezero run at W = 2 (gloo, fresh ``torchrun`` processes): ZeRO stage 3, params and
optimizer state (and with them the reduced gradients) in NVMe swap files, fp32, expert
parallelism ``ep_size`` so each rank steps only its own experts (no expert all-gather). Each
rank times its initialisation (the sharded build and the swap files written), ``timed``
training steps (each with the bytes its process moved to and from the disk, ``/proc/self/io``,
and through the swap engine, ``AsyncIO.stats``), one checkpoint save, a cold load of it into
the same engine and one more step (the resume). The disk's direct-I/O bandwidth is measured
with ``dd`` in the swap folder right before and right after the run (``machine.dd_bandwidth``);
a step's disk time is its bytes at those speeds (both ranks share the disk), and the report
gives the step time's ratio to it. The DeepSpeed peer row is read from ``--peer-json`` (written
by ``benchmarks/deepspeed_scale.py``); without one the row says "not run". The ranks run in
the default environment: the glibc setting the series once passed them
(``MALLOC_MMAP_THRESHOLD_=1048576``) is made by the engine itself for offloaded tiers
(``moezero.offload.malloc``), so the series measures what ``moezero train`` gets.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

SCALE_CONFIG = "moezero stage 3 + nvme/nvme, fp32"
SCALE_OPTIONS = {"zero_optimization.stage": 3,
                 "zero_optimization.offload_optimizer.device": "nvme",
                 "zero_optimization.offload_optimizer.nvme_path": "{work}/scale-nvme",
                 "zero_optimization.offload_param.device": "nvme",
                 "zero_optimization.offload_param.nvme_path": "{work}/scale-nvme",
                 "zero_optimization.offload_param.read_ahead": 2,
                 "zero_optimization.reduce_bucket_size": 20_000_000,
                 "zero_optimization.allgather_bucket_size": 20_000_000}
"""moezero's configuration of the series (``{work}``: the bench work directory). Smaller
buckets than the default keep the reduction's send buffers (80 MB each) small beside the
3 GiB budget. ``read_ahead`` is the default (two gather units of 200 MB), written out so the
report shows it: on the 20-layer model it gave 2.44 GiB per rank and 1.33x the disk time, one
unit 2.25 GiB and 1.60x (steps of 95-129 s). On the earlier 10-layer model (400 MB units) two
gave 3.36 GiB (1.52x), one 3.00 GiB (1.45x), none 2.63 GiB (1.94x, on a busier machine)."""

_TRAIN = {"micro_batch_size": 1, "seq_len": 256, "lr": 3e-4, "seed": 0, "warmup": 0, "timed": 3}
SCALE_SIZES = {
    "quick": {"model": {"vocab_size": 256, "dim": 1024, "n_layers": 1, "n_heads": 8,
                        "ffn_dim": 2048, "num_experts": 32, "top_k": 2, "ep_size": 2},
              "train": _TRAIN, "dd_mib": 512},
    "full": {"model": {"vocab_size": 256, "dim": 1024, "n_layers": 20, "n_heads": 8,
                       "ffn_dim": 1000, "num_experts": 32, "top_k": 2, "ep_size": 2},
             "train": _TRAIN, "dd_mib": 1024},
}
"""The series' model per mode: ``full`` is 2.05 B parameters in 20 layers (32 experts of
width 1000 per MoE layer, 16 per rank at ep 2, so a gather unit is 200 MB; fp32 master +
moments + param shard = 32.8 GB of training state), ``quick`` one layer of 32 experts of width
2048 (0.21 B). An earlier full model (10 layers of width 2000, 2.01 B) had 400 MB units: with
one unit read ahead its peak RSS was 3.00 GiB per rank, 2.2 MiB over the 3 GiB target; with
two, 3.36 GiB. Halving the unit is what lets two units be read ahead within the budget."""

TARGETS = {"rss_bytes": 3 * 2**30, "disk_ratio": 1.5, "params": 2.0e9, "experts": 32}


def scale_spec(mode: str) -> dict:
    """The run spec of the series (``benchmarks.worker`` JSON)."""
    size = SCALE_SIZES[mode]
    return {"name": SCALE_CONFIG, "system": "moezero", "options": dict(SCALE_OPTIONS),
            "model": dict(size["model"]), "train": dict(size["train"]), "checkpoint": True,
            "series": "scale", "world_size": 2}


# ---------------------------------------------------------------- inside a rank


def proc_io() -> dict:
    """This process's bytes read from and written to storage so far (``/proc/self/io``)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read": int(fields["read_bytes"]), "write": int(fields["write_bytes"])}


def _swap_bytes(trainer) -> int:
    """Bytes the engine's swap I/O engine has moved so far (its ``stats``)."""
    opt = trainer.engine.optimizer
    swap = opt.optim_swap or getattr(opt, "param_swap", None)
    return sum(swap.io.stats.values()) if swap is not None else 0


def _timed_step(trainer, batches) -> dict:
    import torch
    import torch.distributed as dist

    before, swap0 = proc_io(), _swap_bytes(trainer)
    start = time.perf_counter()
    loss, _ = trainer.step(torch.from_numpy(batches.next()))
    dist.barrier()
    after = proc_io()
    return {"s": time.perf_counter() - start, "loss": loss, "swap": _swap_bytes(trainer) - swap0,
            "read": after["read"] - before["read"], "write": after["write"] - before["write"]}


def scale_rank(spec: dict) -> dict:
    """One rank of the series: init, steps, save, cold load, one resumed step (raw figures)."""
    import torch
    import torch.distributed as dist

    from benchmarks.common import AnonPeak, anon_rss, tree_bytes
    from benchmarks.moezero_trainer import MoezeroTrainer
    from benchmarks.worker import _barrier_timed, drop_page_cache
    from moezero.telemetry import PeakMemory

    memory = PeakMemory(torch.device("cpu"))  # VmHWM, restarted at each phase (clear_refs)
    anon_start, sampler = anon_rss(), AnonPeak()
    start = time.perf_counter()
    trainer = MoezeroTrainer(spec)
    dist.barrier()
    out = {"status": "ok", "anon_start": anon_start, "init_s": time.perf_counter() - start,
           "info": trainer.info}
    phases = {"init": memory.peak()}
    memory.reset()
    out["steps"] = [_timed_step(trainer, trainer.batches) for _ in range(spec["train"]["timed"])]
    phases["train"] = memory.peak()
    folder = spec["ckpt_dir"]
    memory.reset()
    out["save_s"] = _barrier_timed(trainer.save, folder)
    phases["save"] = memory.peak()
    out["ckpt_bytes"] = tree_bytes(folder)[0]
    if dist.get_rank() == 0:
        drop_page_cache(folder)
    memory.reset()
    out["load_s"] = _barrier_timed(trainer.load, folder)
    phases["load"] = memory.peak()
    memory.reset()
    out["resumed"] = _timed_step(trainer, trainer.batches)
    phases["resumed"] = memory.peak()
    out.update(anon_peak=sampler.stop(), peak_rss=max(phases.values()), phase_rss=phases)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    trainer.close()
    return out


# ---------------------------------------------------------------- the harness


def read_peer(path: str | None) -> dict:
    """The DeepSpeed peer's JSON (``benchmarks/deepspeed_scale.py``), or why there is none."""
    if not path:
        return {"ok": False, "error": "not run (no --peer-json given)"}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        return {"ok": False, "error": f"not run ({path}: {type(exc).__name__})"}


def run_scale(args, work: Path) -> dict:
    """dd, the run, dd again; the peer's JSON beside it."""
    from benchmarks.machine import dd_bandwidth, machine_info
    from benchmarks.run import command_line, run_one

    mode = "quick" if args.quick else "full"
    swap = work / "scale-nvme"
    swap.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine_info(), "command": command_line(), "mode": mode,
               "size": SCALE_SIZES[mode], "dd_before": dd_bandwidth(swap, SCALE_SIZES[mode]["dd_mib"])}
    results["run"] = run_one(scale_spec(mode), f"scale-{mode}", args, work)
    results["dd_after"] = dd_bandwidth(swap, SCALE_SIZES[mode]["dd_mib"])
    results["peer"] = read_peer(args.peer_json)
    shutil.rmtree(swap, ignore_errors=True)
    shutil.rmtree(work / "ckpt" / f"scale-{mode}", ignore_errors=True)
    return results


def run_scale_only(args, out: Path, work: Path) -> int:
    """``--series scale`` alone: measure (or read ``--from-json``), rewrite only its section."""
    from benchmarks.fmt import splice
    from benchmarks.tables_scale import scale_section

    start = time.perf_counter()
    if args.from_json:  # a later --peer-json (the peer ran after) replaces the stored row
        results = json.loads(Path(args.from_json).read_text())
        if args.peer_json:
            results["peer"] = read_peer(args.peer_json)
    else:
        results = run_scale(args, work)
        (work / "results-scale.json").write_text(json.dumps(results, indent=1))
    section = scale_section(results)
    old = out.read_text() if out.exists() else "# Benchmarks\n"
    out.write_text(splice(old, section))
    print("\n".join(section))
    print(f"updated the scale section of {out} ({time.perf_counter() - start:.0f} s)")
    return 0
