"""``python -m benchmarks.gpu --check``: a lent GPU's first session in one command (issue 29).

In order, each in a fresh process with its own time limit (under 10 minutes in all on one
H100): (1) ``moezero train`` of the embedded default recipe with NCCL at W = 1 (``moe.ep_size``
set to 1: the recipe's 2 needs two ranks), (2) the ``gpu``-marked tests (``pytest -m gpu``,
with ``CUBLAS_WORKSPACE_CONFIG`` exported as ``moezero train`` does), (3) every row of
``benchmarks.gpu`` at a reduced size. Prints one table; on a GPU it also replaces its section
of ``--out`` (BENCHMARKS.md), headed with the device name. ``--check --smoke`` runs the same
steps on CPU (gloo, the tiny rows) to check the runner; it writes nothing. ``nox -s gpu``
installs what it needs (``MOEZERO_TORCH``, the ``dev``, ``reference`` and ``data`` extras) and
runs it; without JAX the tests step skips ``tests/reference`` and says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.fmt import splice, table
from benchmarks.gpu_rows import REPO, ROWS, SMOKE_MODEL, SMOKE_TRAIN, run_row
from benchmarks.launch import error_line

SECTION = "## GPU check: the first session on a lent device (issue 29)"
CHECK_MODEL = {"vocab_size": 32000, "dim": 1024, "n_layers": 4, "n_heads": 16, "ffn_dim": 1536,
               "num_experts": 16, "top_k": 2}
CHECK_TRAIN = {"micro_batch_size": 4, "seq_len": 1024, "lr": 3e-4, "seed": 0, "warmup": 2,
               "timed": 4}
TRAIN_S, TESTS_S, ROW_S = 120, 240, 40
"""Time limits (seconds) of the train step, the test step and each benchmark row."""


def run_step(name: str, argv: list[str], timeout: float, log: Path, env: dict | None = None):
    """Run ``argv`` from the repository root; a table row ``[name, status, seconds, detail]``."""
    start = time.perf_counter()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                timeout=timeout, env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout:.0f} s"
    took = f"{time.perf_counter() - start:.0f}"
    text = log.read_text()
    last = next((ln for ln in reversed(text.splitlines()) if ln.strip()), "")
    detail = last if rc == 0 else rc if isinstance(rc, str) else error_line(text)
    return [name, "ok" if rc == 0 else "failed", took, detail[:120].replace("|", "/")]


def check(args) -> int:
    """The three steps; exit 0 only when every one passed."""
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.gpu --check: no CUDA GPU here (add --smoke to check the runner on CPU)")
        return 2
    work = Path(args.work_dir) / "check"
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    rows = [run_step("moezero train: default recipe, " + ("gloo (smoke)" if args.smoke else
                                                           "NCCL") + ", W = 1",
                     [py, "-m", "moezero.cli", "train", "--nproc", "1", "--set", "moe.ep_size=1",
                      "--set", "train.steps=10", "--out", str(work / "train")],
                     TRAIN_S, work / "train.log"),
            run_step("pytest -m gpu (tests/)",
                     [py, "-m", "pytest", "-m", "gpu", "tests", "-q", "-p", "no:cacheprovider",
                      "-rs"], TESTS_S, work / "tests.log",
                     env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})]
    args.timeout = ROW_S
    for name, system, options, grouped in ROWS:
        start = time.perf_counter()
        r = run_row(name, system, options, grouped, args, work,
                    model=SMOKE_MODEL if args.smoke else CHECK_MODEL,
                    train=SMOKE_TRAIN if args.smoke else CHECK_TRAIN)
        took = f"{time.perf_counter() - start:.0f}"
        ok = r.get("status") == "ok"
        detail = (f"{r['tokens_per_s']:,.0f} tokens/s" if ok
                  else str(r.get("error"))[:120].replace("|", "/"))
        rows.append([f"benchmark row: {name}", "ok" if ok else "failed", took, detail])
    device = "CPU (smoke run)" if args.smoke else torch.cuda.get_device_name(0)
    lines = [SECTION, "", f"Device: **{device}**; torch {torch.__version__}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Command: "
             "`python -m benchmarks.gpu --check`. Logs: " + str(work) + ".", "",
             *table(["step", "status", "seconds", "detail"], rows)]
    print("\n".join(lines))
    if not args.smoke:
        out = Path(args.out)
        out.write_text(splice(out.read_text() if out.exists() else "# Benchmarks\n", lines))
    return 0 if all(r[1] == "ok" for r in rows) else 1
