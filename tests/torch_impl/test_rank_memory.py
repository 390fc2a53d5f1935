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


def test_a_built_adamw_kernel_loads_without_cpp_extension():
    """Every rank loads the host AdamW kernel at optimizer construction; importing
    torch.utils.cpp_extension to check the build (setuptools, distutils, pkg_resources) costs
    ~11 MiB per rank, so a current, stamped build is imported directly (zero/kernel_cache.py)."""
    from moezero.zero.hostadam import load_compiled

    module, why = load_compiled.__wrapped__()  # builds or checks it, and stamps it, now
    if module is None:
        pytest.skip(f"the compiled AdamW kernel did not build here: {why}")
    new = imported_after("from moezero.zero.hostadam import load_compiled\n"
                         "module, why = load_compiled()\nassert module is not None, why\n"
                         "assert module.adamw_step and module.square_sum")
    assert not {"torch.utils.cpp_extension", "setuptools", "pkg_resources"} & new


def test_the_stamp_names_the_library_only_while_it_is_current(tmp_path, monkeypatch):
    from moezero.zero import kernel_cache

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder, source = tmp_path / "ext", tmp_path / "k.cpp"
    folder.mkdir()
    source.write_text("int f() { return 1; }")
    library = folder / "ext.so"
    library.write_bytes(b"library")
    assert kernel_cache.find("ext", source, ["-O3"]) is None  # never stamped
    kernel_cache.record(library, source, ["-O3"])
    assert kernel_cache.find("ext", source, ["-O3"]) == library
    assert kernel_cache.find("ext", source, ["-O2"]) is None  # other flags
    (folder / "lock").touch()  # torch's build lock: a build under way
    assert kernel_cache.find("ext", source, ["-O3"]) is None
    (folder / "lock").unlink()
    source.write_text("int f() { return 2; }")  # another source
    assert kernel_cache.find("ext", source, ["-O3"]) is None
    kernel_cache.record(library, source, ["-O3"])
    library.write_bytes(b"rebuilt by another process")
    assert kernel_cache.find("ext", source, ["-O3"]) is None
