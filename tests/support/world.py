"""Run a function on W gloo ranks for a test: fresh FileStore rendezvous, short timeouts.

``run_world(fn, world, tmp_path, *args)`` returns each rank's return value (pickled through
``tmp_path``; test-only). ``fn`` must be a module-level function (the ranks import it). Gloo
ranks are forked from a fork server that imported torch and moezero once (``ranks``); NCCL
ranks, and a world of one (run in this process), go through moezero's launcher.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch.distributed as dist

from moezero.distributed.launcher import spawn
from tests.support.ranks import start_world

TIMEOUT_S = 60.0


def _capture(fn, out_dir: str, args: tuple) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    result = fn(*args)
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_world(fn, world: int, tmp_path: Path, *args, timeout_s: float = TIMEOUT_S,
              backend: str = "gloo") -> list:
    """``fn(*args)`` on ``world`` ranks; ``backend="nccl"`` for the GPU tests (one device per
    rank, ``moezero.distributed.devices``)."""
    out = Path(tmp_path) / f"results_w{world}_{fn.__name__}"
    out.mkdir(parents=True, exist_ok=True)
    # gloo: every rank computes on the host, also on a GPU machine (moezero.distributed.devices)
    capture = (fn, str(out), args)
    if backend == "gloo" and world > 1:
        code = start_world(_capture, world, capture, timeout_s)
    else:
        code = spawn(_capture, world, capture, backend=backend, timeout_s=timeout_s)
    assert code == 0, f"a rank of {fn.__name__} failed (exit code {code}); see stderr"
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(world)]
