"""Kill the launcher (``kill -9``, as an OOM killer or a dying job step does) at random moments
after the first step of the default recipe, ``--runs`` times (issue 25, item 2).

Each run must end with a checkpoint that is complete and verifies, of the step the kill
interrupted or later (the ranks finish that step, agree and save it: the last row of
``metrics.jsonl``), rank 0's line naming the launcher's death, and every rank gone. The run
then resumes from ``latest`` to ``--steps``, and must reproduce an uninterrupted reference run
bit for bit: the same loss and grad norm on every resumed step, and byte-identical weights and
optimizer state in the final checkpoint. A dead launcher's rendezvous folder is removed by the
next start. Usage::

    python -m tests.faults.kill_launcher --runs 20 [--steps 10] [--work DIR] [--seed 0]

Exits 0 when every run passes; prints one line per run and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moezero.plan import store

COMPARED = ("loss", "grad_norm", "lr")


def _train(out: Path, steps: int, tmp: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp)}
    return subprocess.Popen([sys.executable, "-m", "moezero.cli", "train", "--set",
                             f"train.steps={steps}", *extra, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    """The output once every process holding it (the orphaned ranks too) has exited."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def _tensor_files(step_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(step_dir.glob("*.safetensors"))}


def reference(work: Path, steps: int, timeout: float) -> tuple[list[dict], dict[str, bytes]]:
    """An uninterrupted run: its metrics and its final checkpoint's tensor files."""
    out = work / "reference"
    output = _finish(_train(out, steps, work / "tmp"), timeout)
    if not (out / "checkpoints" / f"step_{steps:08d}").is_dir():
        raise SystemExit(f"the reference run failed:\n{output[-3000:]}")
    return _rows(out), _tensor_files(out / "checkpoints" / f"step_{steps:08d}")


def _kill_at_random(proc: subprocess.Popen, out: Path, steps: int, rng: random.Random,
                    timeout: float) -> int | None:
    """SIGKILL the launcher at a random moment after the first step; the step it interrupted
    (the last finished one then), or None when the run ended first."""
    target, deadline = rng.randint(1, steps // 2), time.monotonic() + timeout
    while len(rows := _rows(out)) < target:
        if proc.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    time.sleep(rng.uniform(0, rows[-1]["step_time_s"]))
    interrupted = _rows(out)[-1]["step"]
    if proc.poll() is not None:
        return None
    os.kill(proc.pid, signal.SIGKILL)
    return interrupted


def one_run(work: Path, index: int, steps: int, rng: random.Random, ref_rows: list[dict],
            ref_files: dict[str, bytes], timeout: float) -> str | None:
    """One kill and resume; None when it passes, else what failed."""
    out, tmp = work / f"run{index:02d}", work / "tmp"
    proc = _train(out, steps, tmp)
    interrupted = _kill_at_random(proc, out, steps, rng, timeout)
    output = _finish(proc, timeout)
    if interrupted is None:
        return f"the run ended before the kill:\n{output[-2000:]}"
    root = out / "checkpoints"
    latest = store.find_latest(root)
    if latest is None:
        return f"no checkpoint after a kill at step {interrupted}:\n{output[-2000:]}"
    saved = int(latest.name.removeprefix("step_"))
    problems = store.verify(latest)
    if saved < interrupted or problems or saved != _rows(out)[-1]["step"]:
        return (f"kill at step {interrupted}: latest {latest.name}, last metrics step "
                f"{_rows(out)[-1]['step']}, verify: {problems[:3]}")
    if f"preempted after step {saved} (the launcher died)" not in output:
        return f"no preemption line for step {saved}:\n{output[-2000:]}"
    resumed = _finish(_train(out, steps, tmp, "--set", "checkpoint.load=latest"), timeout)
    if f"at step {saved}" not in resumed:
        return f"the resume from step {saved} failed:\n{resumed[-2000:]}"
    return _compare(out, saved, steps, ref_rows, ref_files, interrupted)


def _compare(out: Path, saved: int, steps: int, ref_rows: list[dict],
             ref_files: dict[str, bytes], interrupted: int) -> str | None:
    rows = _rows(out)
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        return f"metrics steps {[r['step'] for r in rows]}"
    for row, ref in zip(rows, ref_rows, strict=True):
        if any(row[k] != ref[k] for k in COMPARED):
            return (f"step {row['step']} differs from the reference (resumed at {saved}): "
                    f"{[(k, row[k], ref[k]) for k in COMPARED if row[k] != ref[k]]}")
    if _tensor_files(out / "checkpoints" / f"step_{steps:08d}") != ref_files:
        return f"the final checkpoint's tensors differ from the reference (resumed at {saved})"
    print(f"  killed with step {interrupted} the last logged, saved step {saved}, resumed "
          "bitwise", flush=True)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10,
                        help="total steps of each run (killed in its first half)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="moezero-kill-launcher-"))
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    ref_rows, ref_files = reference(work, args.steps, args.timeout)
    failures = 0
    for index in range(args.runs):
        problem = one_run(work, index, args.steps, rng, ref_rows, ref_files, args.timeout)
        failures += problem is not None
        print(f"run {index + 1}/{args.runs}: {'ok' if problem is None else 'FAILED: ' + problem}",
              flush=True)
    left = sorted((work / "tmp").glob("moezero-rdzv-*"))
    print(f"{args.runs - failures}/{args.runs} runs passed; rendezvous folders left: "
          f"{[p.name for p in left]}; work dir {work}", flush=True)
    return 0 if failures == 0 and not left else 1


if __name__ == "__main__":
    sys.exit(main())
