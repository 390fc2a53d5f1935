"""The preemption agreement costs one collective per step (issue 25, item 8): a run with a
``StopRequest`` issues exactly ``steps`` more collectives than the same run without one (and
no time-based saves), and the save clock (``checkpoint.every_minutes``) rides in that same
collective: turning it on beside the request adds none.
Collectives are counted by wrapping every ``torch.distributed`` collective in the ranks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch.distributed as dist

from moezero.config import Config
from moezero.distributed.signals import PreemptOptions, StopRequest
from moezero.train import train
from tests.support.world import run_world
from tests.torch_impl.test_checkpoint import ccfg

STEPS = 3
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "barrier", "all_gather_object",
               "broadcast_object_list", "all_to_all", "all_to_all_single", "reduce", "gather",
               "scatter")


def _counting(counts: Counter) -> None:
    """Replace each collective of ``torch.distributed`` by a wrapper counting its calls."""
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapper(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, wrapper)


def _collectives_with_and_without_stop(root: str) -> tuple[dict, dict, dict]:
    counts: list[Counter] = []
    for name, minutes, stop in (("plain", 0, None), ("stop", 0, StopRequest(PreemptOptions(()))),
                                ("clock", 30, StopRequest(PreemptOptions(())))):
        cfg = Config.model_validate(ccfg(world=2, stage=2))
        cfg.train.steps, cfg.checkpoint.every_minutes = STEPS, minutes
        counts.append(Counter())
        saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
        _counting(counts[-1])
        try:
            train(cfg, Path(root, name), stop=stop)
        finally:
            for n, fn in saved.items():
                setattr(dist, n, fn)
    return dict(counts[0]), dict(counts[1]), dict(counts[2])


def test_the_preemption_agreement_is_one_collective_per_step(tmp_path):
    for plain, with_stop, with_clock in run_world(_collectives_with_and_without_stop, 2,
                                                  tmp_path, str(tmp_path)):
        extra = Counter(with_stop)
        extra.subtract(plain)
        assert {k: v for k, v in extra.items() if v} == {"all_reduce": STEPS}, (plain, with_stop)
        assert with_clock == with_stop, (with_stop, with_clock)
