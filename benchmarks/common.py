"""Pieces every benchmarked system shares inside a rank: the model shape, the data, sizes.

Imports torch_impl's model and data modules only (no pydantic), so the peer venv can use it
with the repository on ``sys.path``; the memory helpers import no moezero module at all, so a
peer script that uses only them needs no moezero install (``benchmarks/deepspeed_scale.py``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# The synthetic corpus settings of moezero.config.DataConfig's defaults.
CORPUS = {"vocab": 32, "sources": 4, "seed": 1234}
INIT_STD = 0.02


class Unsupported(Exception):
    """The system cannot run this configuration yet (reported, not fatal)."""


def model_args(model: dict, *, ep_size: int):
    """The decoder shape of a run spec's ``model`` block with the given expert parallelism."""
    from moezero.model.decoder import ModelArgs

    return ModelArgs(vocab_size=model["vocab_size"], dim=model["dim"], n_layers=model["n_layers"],
                     n_heads=model["n_heads"], ffn_dim=model["ffn_dim"],
                     num_experts=model["num_experts"], top_k=model["top_k"], ep_size=ep_size,
                     init_std=INIT_STD)


def make_batches(train: dict, *, rank: int, world: int):
    """This rank's slice of the global batches moezero's trainer would draw (same seeds)."""
    from moezero.data import Batches, make_corpus

    corpus = make_corpus(None, **CORPUS)
    return Batches(corpus, global_batch=train["micro_batch_size"] * world,
                   seq_len=train["seq_len"], seed=train["seed"], dp_rank=rank, dp_size=world)


def anon_rss() -> int:
    """This process's resident anonymous memory now, in bytes: resident minus file-backed and
    shared pages (Linux ``/proc/self/statm``). Unlike RSS it does not count library pages
    mapped from disk, whose residency depends on the page cache and the venv."""
    _, resident, shared = Path("/proc/self/statm").read_text().split()[:3]
    return (int(resident) - int(shared)) * os.sysconf("SC_PAGE_SIZE")


class AnonPeak:
    """Peak of :func:`anon_rss`, sampled every ``interval_s`` by a daemon thread until stop()."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s, self.peak = interval_s, anon_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, anon_rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_rss())
        return self.peak


def peak_rss() -> int:
    """This program's peak resident set size so far, in bytes (``VmHWM``)."""
    from moezero.memory.peak import peak_memory_bytes

    return peak_memory_bytes(torch.device("cpu"))


def tree_bytes(folder: str | os.PathLike) -> tuple[int, int]:
    """(total bytes, number of files) under ``folder``."""
    total = files = 0
    for root, _, names in os.walk(folder):
        for name in names:
            total += os.path.getsize(os.path.join(root, name))
            files += 1
    return total, files


def barrier_timed(fn, folder: str) -> float:
    """Wall time of ``fn(folder)`` on every rank, from a barrier before to a barrier after."""
    dist.barrier()
    start = time.perf_counter()
    fn(folder)
    dist.barrier()
    return time.perf_counter() - start


def drop_page_cache(folder: str) -> None:
    """Flush every file under ``folder`` and ask the kernel to drop its cached pages, so the
    next read comes from the disk (``posix_fadvise(DONTNEED)``; needs no privileges)."""
    drop_files(os.path.join(root, name) for root, _, names in os.walk(folder) for name in names)


def drop_files(paths) -> None:
    """``fsync`` each file, then drop its pages from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_gathered(spec: dict, record: dict, result_path: str) -> None:
    """Gather every rank's ``record``; rank 0 writes ``{"spec", "ranks"}`` to ``result_path``
    (the result file the harness reads: ``benchmarks.launch``)."""
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, record)
    if dist.get_rank() == 0:
        Path(result_path).write_text(json.dumps({"spec": spec, "ranks": ranks}))


def rank_main(run_rank, argv: list[str] | None = None, *, threads: int | None = None,
              timeout_s: float = 300.0) -> int:
    """One benchmark rank, ``SPEC.json RESULT.json`` (``argv``, else the command line): torch
    on ``threads`` threads (else ``OMP_NUM_THREADS``, 1 by default), a gloo world, and
    ``run_rank(spec)``'s record gathered into the result file; a run that raises
    ``Unsupported`` records its reason instead. ``timeout_s``: the collectives' timeout."""
    spec_path, result_path = argv if argv is not None else sys.argv[1:]
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        try:
            record = run_rank(spec)
        except Unsupported as exc:
            record = {"status": "unsupported", "note": str(exc)}
        write_gathered(spec, record, result_path)
    finally:
        dist.destroy_process_group()
    return 0
