"""Start one benchmark run: a spec in fresh ``torchrun`` processes
(``-m benchmarks.worker``), its result or its failure as one line. Used by the harnesses
(``benchmarks.run``, ``benchmarks.scale``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception)\b|error:|terminate called)")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")  # torchrun's prefix on a rank's stderr lines
_NOISE = ("ChildFailedError", "torch.distributed.elastic")


def error_line(log: str) -> str:
    """The most telling line of a failed run's output: its last exception line."""
    lines = [_RANK_PREFIX.sub("", ln.strip()) for ln in log.splitlines() if ln.strip()]
    hits = [ln for ln in lines if _ERROR_LINE.match(ln) and not any(n in ln for n in _NOISE)]
    return (hits or lines or ["no output"])[-1][:300]


def run_one(spec: dict, tag: str, args: argparse.Namespace, work: Path) -> dict:
    """One configuration in fresh torchrun processes; the parsed result or the failure."""
    options = {k: v.replace("{work}", str(work)) if isinstance(v, str) else v
               for k, v in spec["options"].items()}
    for key, folder in options.items():
        if key.endswith("nvme_path"):  # swap folders must exist (the engine checks free space)
            Path(folder).mkdir(parents=True, exist_ok=True)
    spec = {**spec, "options": options, "ckpt_dir": str(work / "ckpt" / tag)}
    paths = {k: work / sub / f"{tag}.{ext}" for k, sub, ext in
             (("spec", "specs", "json"), ("result", "results", "json"), ("log", "logs", "log"))}
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    paths["spec"].write_text(json.dumps(spec))
    paths["result"].unlink(missing_ok=True)
    python = args.peer_python if spec["system"] == "deepspeed" else sys.executable
    rc, wall = torchrun(python, "benchmarks.worker", spec["world_size"], paths, args.timeout)
    if not isinstance(rc, str) and paths["result"].exists():
        # Rank 0 writes the file after gathering every rank's record: the measurements are
        # complete even when a process then dies at teardown (seen: FSDP2 ranks aborting with
        # "terminate called without an active exception" after destroy_process_group). Kept,
        # and the exit is reported.
        out = json.loads(paths["result"].read_text())
        run = {**out, "status": out["ranks"][0]["status"], "wall_s": wall, "tag": tag}
        if rc:
            run["exit_note"] = f"exit code {rc} after writing its results: " \
                               f"{error_line(paths['log'].read_text())}"
        return run
    error = rc if isinstance(rc, str) else error_line(paths["log"].read_text())
    return {"spec": spec, "status": "failed", "error": error, "wall_s": wall, "tag": tag}


def torchrun(python: str, module: str, nproc: int, paths: dict, timeout: float):
    """``python -m module SPEC RESULT`` (``paths``) in ``nproc`` fresh torchrun processes, one
    thread each, output to ``paths["log"]``: (the exit code, or why it did not finish as a
    line; wall seconds)."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", module, str(paths["spec"]), str(paths["result"])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    try:
        with open(paths["log"], "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                timeout=timeout, check=False).returncode
    except subprocess.TimeoutExpired:
        rc = f"timed out after {timeout:.0f} s"
    except OSError as exc:
        rc = f"cannot start {python}: {exc}"
    return rc, time.perf_counter() - start


def command_line() -> str:
    return "python -m benchmarks.run " + shlex.join(sys.argv[1:])
