"""Per-rank anonymous memory of the main benchmark model, phase by phase.

``torchrun --standalone --nproc_per_node 2 -m benchmarks.memory_phases [PACKAGE] [OUT.json]``

Runs what ``benchmarks.worker`` runs for ``moezero stage 2`` in quick mode (imports, config,
model build, engine init, data, then 1 + 10 steps through ``engine.forward`` / ``backward`` /
``reduce_gradients`` / ``optimizer_step``) with a 2 ms sampler of ``anon_rss`` that keeps the
peak of each phase. Printed per phase on rank 0: anonymous memory at its end and its peak, in
MiB. ``PACKAGE`` is the import name of the torch side (``moezero``; ``torch_impl`` in trees
before the package was renamed, e.g. 4dbeff4), so the same probe measures both.
Not part of ``benchmarks.run``: a tool for finding where memory went (BENCHMARKS.md,
"Where the main table's memory goes").
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import anon_rss

MIB = 2**20
STEADY_STEPS = 10


class PhaseSampler:
    """Anonymous memory sampled every ``interval_s``; the peak of each named phase."""

    def __init__(self, interval_s: float = 0.002):
        self.rows: list[dict] = []
        self.name, self.peak, self.start = "start", anon_rss(), anon_rss()
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval_s,), daemon=True)
        self._thread.start()

    def _sample(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            now = anon_rss()
            with self._lock:
                self.peak = max(self.peak, now)

    def mark(self, next_name: str) -> None:
        """End the current phase (its end and peak recorded) and start ``next_name``."""
        now = anon_rss()
        with self._lock:
            self.rows.append({"phase": self.name, "end": now, "peak": max(self.peak, now)})
            self.name, self.peak = next_name, now

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.rows


def _overrides(spec: dict) -> list[str]:
    for module in ("benchmarks.specs", "benchmarks.moezero_trainer"):  # now, before issue 28
        fn = getattr(importlib.import_module(module), "overrides", None)
        if fn is not None:
            return fn(spec)
    raise ImportError("no overrides() in benchmarks.specs or benchmarks.moezero_trainer")


def _spec() -> dict:
    specs = importlib.import_module("benchmarks.specs")
    return next(s for s in specs.main_specs(specs.SIZES["quick"]) if s["name"] == "moezero stage 2")


def _phased(sampler: PhaseSampler, module, attr: str, name: str) -> None:
    """``module.attr`` marking the start of phase ``name`` when called (if it exists)."""
    fn = getattr(module, attr, None)
    if fn is None:
        return

    def wrapped(*args, **kwargs):
        sampler.mark(name)
        return fn(*args, **kwargs)

    setattr(module, attr, wrapped)


def _train(sampler: PhaseSampler, engine, batches, steps: int) -> None:
    for i in range(steps):
        tag = "step 1" if i == 0 else "steady"
        sampler.mark(f"data ({tag})")
        batch = torch.from_numpy(batches.next())
        sampler.mark(f"forward ({tag})")
        loss, _ = engine.forward(batch)
        sampler.mark(f"backward ({tag})")
        engine.backward(loss)
        sampler.mark(f"reduce ({tag})")
        engine.reduce_gradients()
        sampler.mark(f"optimizer step ({tag})")
        engine.optimizer_step()
        loss.item()


def probe(package: str) -> list[dict]:
    """The phases of one rank (collective: every rank runs it)."""
    sampler = PhaseSampler()
    sampler.mark("imports")
    config = importlib.import_module(f"{package}.config")
    train = importlib.import_module(f"{package}.train")
    sampler.mark("config")
    cfg = config.load_config(None, _overrides(_spec()))
    sampler.mark("model build")  # the first of these train.setup calls
    _phased(sampler, train, "initialize", "engine init")
    for attr in ("build_batches", "make_corpus"):
        _phased(sampler, train, attr, "data stream")
    engine, batches = train.setup(cfg, torch.device("cpu"))
    _train(sampler, engine, batches, 1 + STEADY_STEPS)
    sampler.mark("end")
    return sampler.stop()


def table(rows: list[dict], base: int) -> str:
    """Phases merged by name (max of the peaks, last end), in MiB above ``base``."""
    merged: dict[str, dict] = {}
    for row in rows:
        old = merged.setdefault(row["phase"], dict(row))
        old.update(end=row["end"], peak=max(old["peak"], row["peak"]))
    lines = [f"{'phase':28} {'end MiB':>8} {'peak MiB':>9}"]
    lines += [f"{name:28} {(r['end'] - base) / MIB:8.1f} {(r['peak'] - base) / MIB:9.1f}"
              for name, r in merged.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    package = args[0] if args else "moezero"
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    start = time.perf_counter()
    try:
        rows = probe(package)
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, rows)
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        for rank, rank_rows in enumerate(ranks):
            print(f"rank {rank} ({package}; MiB of anonymous memory, absolute):")
            print(table(rank_rows, 0))
        print(f"{time.perf_counter() - start:.1f} s")
        if len(args) > 1:
            Path(args[1]).write_text(json.dumps(ranks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
