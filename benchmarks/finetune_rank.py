"""One rank of a moezero row of the ``finetune`` series:
``torchrun ... -m benchmarks.finetune_rank SPEC.json RESULT.json``.

The library path ``moezero train`` takes (config with ``--set`` overrides, the architecture
adopted from the imported base checkpoint, the data checks, ``setup``, the base loaded), then
warm-up and timed ``engine.train_step`` calls on the prepared chat data, each step's seen and
trained targets counted from its batch, peak anonymous memory sampled from before the model is
built (``benchmarks.common.AnonPeak``), then one checkpoint save timed barrier to barrier.
Rank 0 writes every rank's record as JSON.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (
    AnonPeak,
    anon_rss,
    barrier_timed,
    peak_rss,
    rank_main,
    tree_bytes,
)


def _config(overrides: list[str]):
    from moezero.checkpoint.adopt import adopt_architecture
    from moezero.config import load_config
    from moezero.data.build import check_data

    cfg = load_config(None, overrides)
    cfg, _ = adopt_architecture(cfg, Path("."))
    return check_data(cfg)


def _steps(engine, batches, spec: dict) -> dict:
    """Warm-up then timed steps: wall time, seen and trained targets of each, every loss."""
    from moezero.model.packing import Batch

    out = {"step_s": [], "seen": [], "trained": [], "losses": [], "ce": []}
    for i in range(spec["warmup"] + spec["timed"]):
        batch = Batch.of(batches.next_batch())
        start = time.perf_counter()
        metrics = engine.train_step([batch])
        elapsed = time.perf_counter() - start
        out["losses"].append(metrics["loss"])
        out["ce"].append(metrics["ce"])
        if i >= spec["warmup"]:
            out["step_s"].append(elapsed)
            out["seen"].append(batch.num_seen)
            out["trained"].append(batch.num_trained)
    return out


def _save(engine, batches, folder: str) -> dict:
    """One checkpoint of the run (adapters + their optimizer state for LoRA, everything for
    full SFT), written and waited for between barriers; its bytes and files."""
    seconds = barrier_timed(lambda root: (engine.save_checkpoint(
        root, state={"data": batches.state_dict()}), engine.wait_checkpoint()), folder)
    step = next(p for p in Path(folder).iterdir() if p.name.startswith("step_"))
    size, files = tree_bytes(step)
    return {"save_s": seconds, "bytes": size, "files": files}


def run_rank(spec: dict) -> dict:
    from moezero.train import resume, setup

    anon_start, sampler = anon_rss(), AnonPeak()
    try:
        cfg = _config(spec["overrides"])
        engine, batches = setup(cfg, torch.device("cpu"))
        resume(cfg, engine, batches, Path("."))
        record = _steps(engine, batches, spec)
    finally:
        anon_peak = sampler.stop()
    record.update(anon_start=anon_start, anon_peak=anon_peak, peak_rss=peak_rss())
    record["checkpoint"] = _save(engine, batches, spec["ckpt_dir"])
    engine.close()
    return record


def main(argv: list[str] | None = None) -> int:
    return rank_main(run_rank, argv, threads=1)


if __name__ == "__main__":
    sys.exit(main())
