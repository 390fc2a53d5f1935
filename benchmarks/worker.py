"""One rank of one benchmark run: ``torchrun ... -m benchmarks.worker SPEC.json RESULT.json``.

Joins the torchrun world (gloo), builds the spec's system (moezero, FSDP2 or DeepSpeed) on
the shared model and data, runs warm-up then timed steps, records per-step times, peak RSS,
peak anonymous memory (sampled every 10 ms from before the model is built), moezero's
per-step engine figures, and a checkpoint save, second save and cold load (with optimizer
state in swap files, also a plain copy of those files after each save); rank 0 writes every
rank's raw figures as JSON. Statistics are left to ``benchmarks.stats``.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.common import (
    AnonPeak,
    anon_rss,
    barrier_timed,
    drop_files,
    drop_page_cache,
    peak_rss,
    rank_main,
    tree_bytes,
)
from benchmarks.machine import DD_BESIDE_MIB, dd_write


def build_trainer(spec: dict):
    """The system's trainer: ``.batches``, ``.step(batch) -> (loss, step_call_s)``,
    ``.save(folder)``, ``.load(folder)``, ``.save_note`` (None when it can save), ``.info``
    and, for moezero, ``.trace`` (per-step engine figures)."""
    if spec["system"] == "moezero":
        from benchmarks.moezero_trainer import MoezeroTrainer
        return MoezeroTrainer(spec)
    if spec["system"] == "fsdp2":
        from benchmarks.fsdp2_trainer import Fsdp2Trainer
        return Fsdp2Trainer(spec)
    if spec["system"] == "deepspeed":
        from benchmarks.deepspeed_trainer import DeepSpeedTrainer
        return DeepSpeedTrainer(spec)
    raise ValueError(f"unknown system {spec['system']!r}")


def train_and_time(trainer, spec: dict) -> dict:
    """Warm-up then timed steps; each step's wall time and the time of its step() call."""
    train = spec["train"]
    steps_s, call_s, losses = [], [], []
    for i in range(train["warmup"] + train["timed"]):
        batch = torch.from_numpy(trainer.batches.next())
        start = time.perf_counter()
        loss, step_call = trainer.step(batch)
        elapsed = time.perf_counter() - start
        losses.append(loss)
        if i >= train["warmup"]:
            steps_s.append(elapsed)
            call_s.append(step_call)
    return {"step_s": steps_s, "step_call_s": call_s, "losses": losses,
            "tokens_per_step": train["micro_batch_size"] * train["seq_len"]}


COPY_METHOD = "copy_file_range" if getattr(shutil, "_USE_CP_COPY_FILE_RANGE", False) else "sendfile"
"""What ``shutil.copyfile`` moves the bytes with on Linux in this Python (both in the kernel)."""


def plain_copy(files: list[str], folder: str, name: str) -> dict:
    """A plain copy of the same bytes a save of NVMe-resident state copies: this rank's swap
    files, whole, ``shutil.copyfile`` into a scratch folder under ``folder`` (the checkpoint's
    filesystem), each then fsynced; timed from a barrier to a barrier, like the save. The
    copies stay until the run's checkpoint folder is removed, after the load, so that no
    deletion (and its discards) falls between the timed operations."""
    dest = os.path.join(folder, f"plain-copy-{name}", f"rank{dist.get_rank():05d}")
    os.makedirs(dest, exist_ok=True)
    errors: list[str] = []

    def copy(target: str) -> None:
        try:
            copied = [shutil.copyfile(src, os.path.join(target, os.path.basename(src)))
                      for src in files]
            for path in copied:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as exc:  # reported; the barrier after still runs on this rank
            errors.append(f"plain copy failed: {exc}"[:300])

    seconds = barrier_timed(copy, dest)
    if errors:
        return {"copy_note": errors[0]}
    return {"s": seconds, "bytes": sum(os.path.getsize(f) for f in files), "files": len(files),
            "method": COPY_METHOD}


def _dd_beside(folder: str) -> float | None:
    """Rank 0: a direct-I/O dd write (bytes/s) in the checkpoint's folder, untimed, so each
    save is compared with the disk's speed of that moment (it drifts on a shared VM); the
    other ranks wait at the save's first barrier. None on other ranks or if dd fails."""
    if dist.get_rank() != 0:
        return None
    os.makedirs(folder, exist_ok=True)
    try:
        return dd_write(folder, DD_BESIDE_MIB)
    except (OSError, RuntimeError) as exc:
        print(f"dd beside the save in {folder} failed: {exc}", file=sys.stderr, flush=True)
        return None


def checkpoint_io(trainer, folder: str) -> dict:
    """Save twice in this process (the first and a second save, each into a fresh folder),
    then drop the second from the page cache and load it (a cold read).

    When the trainer's optimizer state lives in swap files (``trainer.swap_files()``), those
    files are also copied plainly (``plain_copy``) twice, in the order save, copy, copy, save
    (``copy_s`` right after the first save, ``second_copy_s`` right before the second), so a
    drift of the disk's speed falls on both; they are dropped from the page cache before
    each save and each copy. A save or load that raises is reported, not fatal.
    """
    if trainer.save_note is not None:
        return {"note": trainer.save_note}
    if dist.get_rank() == 0:  # one shared folder: removed once, before any rank uses it
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    swap = trainer.swap_files() if hasattr(trainer, "swap_files") else []
    order = ("save_s", "copy_s", "second_copy_s", "second_save_s") if swap else \
        ("save_s", "second_save_s")
    first, second, out = os.path.join(folder, "first"), os.path.join(folder, "second"), {}
    try:
        for key in order:
            name = "second" if key.startswith("second") else "first"
            drop_files(swap)  # each save and each copy reads the swap files from the disk
            if key.endswith("save_s"):
                dd = _dd_beside(folder)
                out[key] = barrier_timed(trainer.save, os.path.join(folder, name))
                if dd is not None and (after := _dd_beside(folder)) is not None:
                    out[key[:-2] + "_dd"] = (dd + after) / 2
            else:  # on every rank, even after a failed copy (the copy has barriers)
                copied, prefix = plain_copy(swap, folder, name), key.removesuffix("copy_s")
                out.update(copied if "copy_note" in copied
                           else {f"{prefix}copy_{k}": v for k, v in copied.items()})
            if key == "save_s":
                out["bytes"], out["files"] = tree_bytes(first)
    except Exception as exc:  # any failure is a figure to report, not a crash
        return {**out, "note": f"save failed: {type(exc).__name__}: {exc}"[:300]}
    if dist.get_rank() == 0:
        drop_page_cache(second)
    load = getattr(trainer, "load", None)
    try:
        if load is None:
            out["load_note"] = "n/a (no load in this trainer)"
        else:
            out["load_s"] = barrier_timed(load, second)
    except Exception as exc:
        out["load_note"] = f"load failed: {type(exc).__name__}: {exc}"[:300]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def run_rank(spec: dict) -> dict:
    """Everything one rank measures (raw); raises Unsupported for a rejected config."""
    if spec["series"] == "scale":  # its own sequence: init, steps, one save, load, resume
        from benchmarks.scale_rank import scale_rank  # moezero's: imported only for its runs
        return scale_rank(spec)
    anon_start, sampler = anon_rss(), AnonPeak()
    try:
        trainer = build_trainer(spec)
        record = train_and_time(trainer, spec)
    finally:
        anon_peak = sampler.stop()
    record.update(status="ok", anon_start=anon_start, anon_peak=anon_peak, peak_rss=peak_rss(),
                  info=trainer.info, trace=getattr(trainer, "trace", {}))
    if spec["checkpoint"]:
        record["checkpoint"] = checkpoint_io(trainer, spec["ckpt_dir"])
    if hasattr(trainer, "close"):
        trainer.close()
    return record


def main(argv: list[str] | None = None) -> int:
    return rank_main(run_rank, argv)


if __name__ == "__main__":
    sys.exit(main())
