"""One rank of the ``bigbase`` series: ``torchrun ... -m benchmarks.bigbase_rank SPEC RESULT``.

The path ``moezero train`` takes (config with ``--set`` overrides, the architecture adopted
from the base, ``setup`` with the base read in place where it applies, the base loaded), then
``steps`` optimizer steps on the prepared chat data, each with its wall time and the bytes this
process read (``/proc/self/io``: ``read_bytes`` from storage, ``rchar`` through read calls);
then, with ``save``, one checkpoint (adapters only); the resume from it is a row of its own
(fresh processes, as a real resume: ``checkpoint.load`` naming it, one step). Peak RSS and
anonymous memory per rank.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from benchmarks.common import AnonPeak, anon_rss, peak_rss, rank_main, tree_bytes
from benchmarks.finetune_rank import _config as _adopted_config


def io_bytes() -> dict[str, int]:
    """This process's ``read_bytes`` and ``rchar`` so far (Linux ``/proc/self/io``)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read_bytes": int(fields["read_bytes"]), "rchar": int(fields["rchar"])}


def _config(overrides: list[str]):
    """The row's config: adopted from its base, or (the compute row, no base) as given."""
    from moezero.config import load_config
    from moezero.data.build import check_data

    cfg = load_config(None, overrides)
    return _adopted_config(overrides) if cfg.checkpoint.load else check_data(cfg)


def progress(what: str, **figures) -> None:
    """One line of this rank's progress on its log (a long run is followed as it goes, and a
    run stopped before its result still tells how far it got)."""
    import json

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"bigbase rank {rank} {time.strftime('%H:%M:%S')} {what} "
          f"{json.dumps({**figures, 'peak_rss': peak_rss(), 'anon': anon_rss()})}", flush=True)


def _engine(overrides: list[str]):
    from moezero.train import frozen_base, resume, setup

    start = time.perf_counter()
    cfg = _config(overrides)
    engine, batches = setup(cfg, torch.device("cpu"), base=frozen_base(cfg, Path(".")))
    progress("set up", seconds=time.perf_counter() - start, **io_bytes())
    resume(cfg, engine, batches, Path("."))
    progress("loaded", seconds=time.perf_counter() - start, **io_bytes())
    return engine, batches


def _steps(engine, batches, count: int) -> list[dict]:
    from moezero.model.packing import Batch

    out = []
    for _ in range(count):
        batch = Batch.of(batches.next_batch())
        before, start = io_bytes(), time.perf_counter()
        loss = engine.train_step([batch])["loss"]
        elapsed, after = time.perf_counter() - start, io_bytes()
        out.append({"step_s": elapsed, "loss": loss,
                    **{k: after[k] - before[k] for k in after}})
        progress("step", **out[-1])
    return out


def newest_step(folder: str) -> Path:
    """The newest ``step_*`` checkpoint in ``folder``."""
    return max(p for p in Path(folder).iterdir() if p.name.startswith("step_"))


def run_rank(spec: dict) -> dict:
    anon_start, sampler = anon_rss(), AnonPeak()
    try:
        engine, batches = _engine(spec["overrides"])
        record = {"steps": _steps(engine, batches, spec["steps"])}
        if spec.get("save"):
            engine.save_checkpoint(spec["ckpt_dir"], state={"data": batches.state_dict()})
            engine.wait_checkpoint()
            progress("saved")
            record["checkpoint"] = str(newest_step(spec["ckpt_dir"]))
            record["checkpoint_bytes"], record["checkpoint_files"] = tree_bytes(
                record["checkpoint"])
        engine.close()
    finally:
        anon_peak = sampler.stop()
    return {**record, "anon_start": anon_start, "anon_peak": anon_peak, "peak_rss": peak_rss()}


def main(argv: list[str] | None = None) -> int:
    return rank_main(run_rank, argv, threads=1, timeout_s=3600.0)  # a 16 B base loads long


if __name__ == "__main__":
    sys.exit(main())
