"""moezero inside a benchmark rank: the library path a user takes (config -> setup -> engine).

The run spec becomes ``--set`` overrides on the default recipe, so a row in
``benchmarks.specs.MOEZERO_CONFIGS`` is exactly what ``moezero train --set ...`` would run.
A stage the config or engine rejects is 'not supported yet'; so is a stage above 0 while
``moezero.zero.sharded`` does not exist, because the stage-0 engine would otherwise run it silently
as plain data parallelism and the row would be a lie.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import time

import torch

from benchmarks.collectives import by_op, counting
from benchmarks.common import Unsupported
from benchmarks.specs import overrides

ADAMW_MODULES = ("moezero.zero.optimizer",)
"""Modules whose ``adamw_step_`` (the one-pass update, ``moezero.zero.hostadam``; ``adamw_``
before issue 28) is timed; a missing one is skipped."""


def _load(spec: dict):
    from moezero.config import ConfigError, load_config

    try:
        cfg = load_config(None, overrides(spec))
    except ConfigError as exc:
        raise Unsupported(f"config rejected: {exc}") from None
    stage = cfg.zero_optimization.stage
    if stage > 0 and importlib.util.find_spec("moezero.zero.sharded") is None:
        raise Unsupported(f"zero_optimization.stage={stage}: not built yet (no moezero.zero.sharded; "
                          "the engine would run it as stage 0)")
    return cfg


class MoezeroTrainer:
    """``engine.train_step`` per step; its gradient reduction and optimizer step timed inside."""

    def __init__(self, spec: dict):
        from moezero.train import setup

        cfg = _load(spec)
        try:
            self.engine, self.batches = setup(cfg, torch.device("cpu"))
        except (NotImplementedError, ValueError) as exc:
            raise Unsupported(f"engine rejected it: {exc}") from None
        self._times = dict.fromkeys(("reduce_gradients", "optimizer_step", "adamw"), 0.0)
        self.trace: dict[str, list] = {"reduce_s": [], "optimizer_s": [], "adamw_s": [],
                                       "engine_peak": [], "collectives": []}
        self.count_collectives = spec.get("count_collectives", False)
        for name in ("reduce_gradients", "optimizer_step"):  # what engine.step() runs
            setattr(self.engine, name, self._timed(getattr(self.engine, name), name))
        _time_adamw(self._timed)
        self.save_note = (None if hasattr(self.engine, "save_checkpoint")
                          else "n/a (not built yet)")
        meter = getattr(self.engine, "meter", None)
        self.info = {"stage": cfg.zero_optimization.stage, "optimizer_elements": self._elements(),
                     "dtype": str(self.engine.dtype).removeprefix("torch."),
                     "persistent_engine_bytes": getattr(meter, "persistent", None),
                     "optimizer_groups": len(getattr(self.engine.optimizer, "slots", ())),
                     "step_call": "engine.reduce_gradients() + engine.optimizer_step()"}

    def _timed(self, method, key: str):
        """``method`` adding its wall time to this step's ``key`` time (instance attribute,
        so the engine's own ``self.method()`` calls go through it)."""

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._times[key] += time.perf_counter() - start

        return timed

    def _elements(self) -> int | None:
        """Adam moment elements this rank holds (= elements its optimizer steps)."""
        try:  # the layout's sizes: also when the state is in swap files
            return sum(row["exp_avg"] for row in self.engine.optimizer.layout())
        except (AttributeError, TypeError):
            return None

    def step(self, batch_BS1: torch.Tensor) -> tuple[float, float]:
        self._times.update(dict.fromkeys(self._times, 0.0))
        with counting() if self.count_collectives else contextlib.nullcontext() as counts:
            metrics = self.engine.train_step([batch_BS1])
        self.last_metrics = metrics  # the engine's row (``phases``: benchmarks.scale_rank)
        if counts is not None:  # collectives of this step, by operation
            self.trace["collectives"].append(by_op(counts))
        t = self._times
        for key, value in (("reduce_s", t["reduce_gradients"]),
                           ("optimizer_s", t["optimizer_step"]), ("adamw_s", t["adamw"]),
                           ("engine_peak", metrics.get("step_peak_engine_bytes"))):
            self.trace[key].append(value)
        return metrics["loss"], t["reduce_gradients"] + t["optimizer_step"]

    def save(self, folder: str) -> None:
        self.engine.save_checkpoint(folder)

    def load(self, folder: str) -> None:
        self.engine.load_checkpoint(folder)

    def swap_files(self) -> list[str]:
        """This rank's optimizer swap files (master, exp_avg, exp_avg_sq of every local group),
        the bytes a save of NVMe-resident state copies; empty when the state is in memory."""
        opt = self.engine.optimizer
        if opt.optim_swap is None:
            return []
        return [str(opt.optim_swap.path(slot, state)) for slot in opt.slots
                for state in opt.optim_swap.states]

    def close(self) -> None:
        """A clean exit: finish saves, remove NVMe swap files."""
        self.engine.close()


def _time_adamw(timed) -> None:
    """Route every ``adamw_step_`` (or ``adamw_``) call of the engine's step through
    ``timed(..., "adamw")``."""
    for name in ADAMW_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr in ("adamw_step_", "adamw_"):
            if hasattr(module, attr):
                setattr(module, attr, timed(getattr(module, attr), "adamw"))
