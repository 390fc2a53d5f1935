"""A ``bigbase`` row in fresh ``torchrun`` processes, watched: every few seconds the free bytes
of the work folder's filesystem, the bytes under the row's own folders (swap, checkpoints) and
each process's RSS; the row is stopped (its process group killed) when it runs past its time or
when the free disk falls below a floor, and the resources at that moment are kept. The peer's
NVMe swap of a 16 B model in bf16 is about the whole free disk of this box: it must not fill it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.launch import REPO, error_line


@dataclass
class Watch:
    """What a watched row's samples found (bytes; ``stopped``: why it was stopped, or None)."""

    min_free: int = 1 << 62
    peak_tree: int = 0
    peak_rss: dict = field(default_factory=dict)
    stopped: str | None = None
    at_stop: dict = field(default_factory=dict)


def tree_size(folders: list[Path]) -> int:
    """Bytes of every file under ``folders`` (missing ones count 0)."""
    total = 0
    for folder in folders:
        for root, _, files in os.walk(folder):
            for name in files:
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except OSError:
                    pass
    return total


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    found = [int(p) for p in out.stdout.split()]
    return [q for p in found for q in [p, *_children(p)]]


def _status(pid: int) -> dict:
    """VmRSS, VmHWM and RssAnon of a process, bytes ({} once gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    keys = ("VmRSS", "VmHWM", "RssAnon")
    return {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in text.splitlines()
            if ln.split(":")[0] in keys}


def _available() -> int:
    line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemAvailable"))
    return int(line.split()[1]) * 1024


def _is_rank(pid: int, module: str) -> bool:
    """Whether ``pid`` runs ``-m module`` (a rank, not torchrun or a compiler it started)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return module.encode() in args and b"torch.distributed.run" not in args


def _sample(watch: Watch, proc: subprocess.Popen, where: Path, folders: list[Path],
            module: str) -> dict:
    free = os.statvfs(where)
    now = {"free_disk": free.f_bavail * free.f_frsize, "tree": tree_size(folders),
           "mem_available": _available(),
           "ranks": {p: s for p in _children(proc.pid) if _is_rank(p, module)
                     and (s := _status(p))}}
    watch.min_free = min(watch.min_free, now["free_disk"])
    watch.peak_tree = max(watch.peak_tree, now["tree"])
    for p, s in now["ranks"].items():
        watch.peak_rss[p] = max(watch.peak_rss.get(p, 0), s.get("VmHWM", 0))
    return now


def _kill(proc: subprocess.Popen) -> None:
    """Kill the row: torchrun's process group and every process below it (its agent starts
    the ranks in sessions of their own, so the group alone leaves them running)."""
    below = _children(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _why_stop(now: dict, limits: dict, elapsed: float) -> str | None:
    if elapsed > limits["timeout_s"]:
        return f"timed out after {limits['timeout_s']:.0f} s"
    if now["free_disk"] < limits["min_free"]:
        return (f"stopped: free disk {now['free_disk'] / 2**30:.1f} GiB < "
                f"{limits['min_free'] / 2**30:.1f} GiB")
    return None


def run_watched(python: str, module: str, spec: dict, paths: dict, limits: dict,
                folders: list[Path]) -> dict:
    """``module`` at W = 2 on ``spec`` (``paths``: spec, result, log files), bounded by
    ``limits`` (``timeout_s``, ``min_free`` bytes), with ``spec["env"]`` added to the ranks'
    environment; the parsed result or the failure, with the watch's figures under ``watch``."""
    paths["spec"].write_text(json.dumps(spec))
    paths["result"].unlink(missing_ok=True)
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", module, str(paths["spec"]), str(paths["result"])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           **spec.get("env", {})}
    watch, start = Watch(), time.perf_counter()
    with open(paths["log"], "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
        while proc.poll() is None:
            now = _sample(watch, proc, Path(paths["log"]).parent, folders, module)
            why = _why_stop(now, limits, time.perf_counter() - start)
            if why:
                watch.stopped, watch.at_stop = why, now
                _kill(proc)
                break
            time.sleep(limits.get("every_s", 5.0))
    wall = time.perf_counter() - start
    record = {"watch": watch.__dict__, "wall_s": wall}
    if proc.returncode == 0 and paths["result"].exists():
        return {"status": "ok", **json.loads(paths["result"].read_text()), **record}
    error = watch.stopped or error_line(Path(paths["log"]).read_text())
    return {"status": "failed", "error": error, "log_tail": error_line(
        Path(paths["log"]).read_text()), **record}
