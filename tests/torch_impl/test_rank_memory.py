"""What a training rank loads and allocates besides the model and its state (the main table's
peak anonymous memory; BENCHMARKS.md, "Where the main table's memory goes"). Each case runs
in a fresh interpreter, so modules another test imported do not hide an import (~3-5 s each).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def imported_after(code: str, timeout: float = 120) -> set[str]:
    """Top-level and ``torch.*`` module names a fresh interpreter holds after running ``code``
    that it did not hold after ``import torch`` (stdout's last line is the JSON list)."""
    script = ("import sys, json, torch\nbefore = set(sys.modules)\n" + code +
              "\nprint(json.dumps(sorted(set(sys.modules) - before)))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


BUILD_ON_META = """
from moezero.config import load_config
from moezero.distributed.topology import build_topology
from moezero.train import sharded_model
cfg = load_config(None, [])
model, _ = sharded_model(cfg, build_topology([1], num_experts=cfg.moe.num_experts))
assert all(p.is_meta for p in model.parameters())
"""


def test_meta_construction_does_not_import_dynamo():
    """``train.sharded_model`` (every rank's model build) on the meta device: nn.Embedding's
    ``normal_`` on a meta tensor is a Python reference kernel that imports torch._dynamo and
    sympy (~70 MiB per rank) unless the fills are skipped (``model/meta.py``)."""
    new = imported_after(BUILD_ON_META)
    assert not {"torch._dynamo", "sympy"} & new


@pytest.mark.parametrize("fill", ["normal_(t)", "trunc_normal_(t)", "kaiming_uniform_(t)",
                                  "xavier_normal_(t)", "ones_(t)"])
def test_on_meta_skips_fills_keeps_flags(fill):
    import torch

    from moezero.model.meta import on_meta

    with on_meta():
        t = torch.nn.Parameter(torch.empty(4, 3))
        out = eval(f"torch.nn.init.{fill}", {"torch": torch, "t": t})
        frozen = torch.nn.Linear(3, 2).requires_grad_(False)
    assert out is t and t.is_meta and t.shape == (4, 3) and t.requires_grad
    assert frozen.weight.is_meta and not frozen.weight.requires_grad
    assert not torch.empty(2).is_meta  # the mode ends with the block
