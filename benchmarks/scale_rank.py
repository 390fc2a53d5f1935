"""One rank of the ``scale`` series (``benchmarks.scale``): init, timed steps, one save, a
cold load and one resumed step, with each phase's peak RSS and the bytes moved to and from the
disk. ``benchmarks.worker`` runs it for a spec of series ``scale``
(``benchmarks.specs.scale_spec``).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import AnonPeak, anon_rss, barrier_timed, drop_page_cache, tree_bytes
from benchmarks.moezero_trainer import MoezeroTrainer
from moezero.telemetry import PeakMemory


def proc_io() -> dict:
    """This process's bytes read from and written to storage so far (``/proc/self/io``)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read": int(fields["read_bytes"]), "write": int(fields["write_bytes"])}


def _swap_bytes(trainer) -> int:
    """Bytes the engine's swap I/O engine has moved so far (its ``stats``)."""
    opt = trainer.engine.optimizer
    swap = opt.optim_swap or getattr(opt, "param_swap", None)
    return sum(swap.io.stats.values()) if swap is not None else 0


def _timed_step(trainer, batches, *, last: bool = True) -> dict:
    """One step, timed to its barrier; the ``last`` also waits for an optimizer step still
    running behind it (``offload_optimizer.step_in_forward``: otherwise the next step's
    forward carries it), so the steps' sum is the run's whole time."""
    before, swap0 = proc_io(), _swap_bytes(trainer)
    start = time.perf_counter()
    loss, _ = trainer.step(torch.from_numpy(batches.next()))
    if last:
        trainer.engine.optimizer.finish_step()
    dist.barrier()
    after = proc_io()
    return {"s": time.perf_counter() - start, "loss": loss, "swap": _swap_bytes(trainer) - swap0,
            "read": after["read"] - before["read"], "write": after["write"] - before["write"],
            "phases": trainer.last_metrics.get("phases")}


def scale_rank(spec: dict) -> dict:
    """One rank of the series: init, steps, save, cold load, one resumed step (raw figures)."""
    memory = PeakMemory(torch.device("cpu"))  # VmHWM, restarted at each phase (clear_refs)
    anon_start, sampler = anon_rss(), AnonPeak()
    start = time.perf_counter()
    trainer = MoezeroTrainer(spec)
    dist.barrier()
    out = {"status": "ok", "anon_start": anon_start, "init_s": time.perf_counter() - start,
           "info": trainer.info}
    phases = {"init": memory.peak()}
    memory.reset()
    timed = spec["train"]["timed"]
    out["steps"] = [_timed_step(trainer, trainer.batches, last=i + 1 == timed) for i in range(timed)]
    phases["train"] = memory.peak()
    if spec.get("checkpoint", True):
        _save_load(trainer, spec["ckpt_dir"], out, phases, memory)
    out.update(anon_peak=sampler.stop(), peak_rss=max(phases.values()), phase_rss=phases)
    dist.barrier()
    trainer.close()
    return out


def _save_load(trainer, folder, out: dict, phases: dict, memory) -> None:
    """One save, a cold load of it into the same engine and one resumed step."""
    memory.reset()
    out["save_s"] = barrier_timed(trainer.save, folder)
    phases["save"] = memory.peak()
    out["ckpt_bytes"] = tree_bytes(folder)[0]
    if dist.get_rank() == 0:
        drop_page_cache(folder)
    memory.reset()
    out["load_s"] = barrier_timed(trainer.load, folder)
    phases["load"] = memory.peak()
    memory.reset()
    out["resumed"] = _timed_step(trainer, trainer.batches)
    phases["resumed"] = memory.peak()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
