"""Checkpoints through the command line on real training runs: ``moezero train`` saving and
resuming, ``moezero checkpoint inspect|verify|export``, corrupted files, and SIGKILL during
saves (the crash-safety chain; the 20-point version is marked slow).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file as load_torch

from moezero.cli import main
from moezero.plan import store
from tests.support.hooked_cli import hooked
from tests.torch_impl.test_checkpoint import ccfg, train_run
from tests.torch_impl.test_cli import TINY, _children, moezero


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real 2-rank run: 4 steps, a checkpoint every 2 (step_2 and step_4)."""
    out = tmp_path_factory.mktemp("cli") / "run"
    res = moezero("train", *TINY, "--set", "train.steps=4", "--set", "checkpoint.every=2",
                  "--out", str(out))
    assert res.returncode == 0, res.stderr
    return out


def cli(capsys, *args) -> tuple[int, str, str]:
    """``moezero`` in this process (fast; the subprocess path is tested once per command)."""
    code = main(list(map(str, args)))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def copy_step(run: Path, dest: Path, step: int = 4) -> Path:
    target = dest / f"step_{step:08d}"
    shutil.copytree(run / "checkpoints" / f"step_{step:08d}", target)
    return target


def test_train_saves_every_n_and_at_the_end(run):
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    assert (root / "latest").read_text() == "step_00000004"
    manifest = store.read_manifest(root / "step_00000004")
    assert manifest.state["client"]["data"]["step"] == 4
    assert manifest.topology["world_size"] == 2 and manifest.topology["zero_stage"] == 2


def test_inspect_and_verify(run, capsys):
    res = moezero("checkpoint", "inspect", str(run / "checkpoints"), timeout=60)
    assert res.returncode == 0, res.stderr
    assert "step 4" in res.stdout and "moe/ep_size_2/layers.0.moe/expert3/decay/0" in res.stdout
    assert "6 groups" in res.stdout and "bytes on disk" in res.stdout
    code, out, err = cli(capsys, "checkpoint", "verify", run / "checkpoints" / "step_00000002")
    assert code == 0 and out.startswith("ok:"), err


def test_verify_names_every_single_byte_flip(run, tmp_path, capsys):
    step = copy_step(run, tmp_path)
    manifest = store.read_manifest(step)
    rng = random.Random(0)
    for _ in range(8):
        f = rng.choice(manifest.layout.files)
        pos = rng.randrange(f.data_start, f.size)  # somewhere in the tensor data
        path = step / f.name
        data = bytearray(path.read_bytes())
        original = data[pos]
        data[pos] ^= rng.randrange(1, 256)
        path.write_bytes(data)
        code, out, err = cli(capsys, "checkpoint", "verify", step)
        assert code == 1, (f.name, pos, out)
        first = err.splitlines()[0]
        begin, end = map(int, re.search(r"bytes \[(\d+), (\d+)\)", first).groups())
        assert f.name in first and begin <= pos < end, (first, pos)
        data[pos] = original
        path.write_bytes(data)
    assert cli(capsys, "checkpoint", "verify", step)[0] == 0
    # through the console script once, with a header byte flipped
    data = bytearray((step / manifest.layout.files[0].name).read_bytes())
    data[20] ^= 1
    (step / manifest.layout.files[0].name).write_bytes(data)
    res = moezero("checkpoint", "verify", str(step), timeout=60)
    assert res.returncode == 1 and manifest.layout.files[0].name in res.stderr.splitlines()[0]


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_a_truncated_or_missing_file_is_one_line_naming_it(run, tmp_path, capsys, damage):
    step = copy_step(run, tmp_path)
    victim = step / "optim-00004-of-00006.safetensors"
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-3])
    else:
        victim.unlink()
    word = "truncated" if damage == "truncate" else "missing"
    code, out, err = cli(capsys, "checkpoint", "verify", step)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert victim.name in err and word in err
    code, _, err = cli(capsys, "train", *TINY, "--set", f"checkpoint.load={step}", "--out",
                       tmp_path / "r")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("moezero: error: checkpoint.load:") and victim.name in lines[0]
    assert not (tmp_path / "r").exists()


def test_bad_load_paths_are_one_line_before_training(run, tmp_path, capsys):
    res = moezero("train", *TINY, "--set", "checkpoint.load=step_00000099", "--out",
                  str(tmp_path / "r"), timeout=60)  # the console script: no traceback
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "step_00000099: no such checkpoint directory" in lines[0]
    for value, message in [("latest", "no checkpoint root"),
                           (tmp_path, "no complete checkpoint"),
                           (run / "checkpoints" / "step_00000003", "no such checkpoint directory")]:
        code, _, err = cli(capsys, "train", *TINY, "--set", f"checkpoint.load={value}", "--out",
                           tmp_path / "r")
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    wider = ["--set", "model.ffn_dim=64", "--set", "checkpoint.load=latest"]
    code, _, err = cli(capsys, "train", *TINY, *wider, "--out", run)
    assert code == 2 and "model.ffn_dim: 64 differs from the checkpoint's 32" in err, err
    allowed = ["--set", "checkpoint.allow_arch_change=[model.ffn_dim]"]
    code, _, err = cli(capsys, "train", *TINY, *wider, *allowed, "--out", run)
    assert code == 2 and "shape (32, 32) in the checkpoint, (64, 32) in the model" in err, err
    assert not (tmp_path / "r").exists()


def test_cli_errors_on_a_directory_without_checkpoints(tmp_path, capsys):
    code, _, err = cli(capsys, "checkpoint", "verify", tmp_path)
    assert code == 2 and "no complete checkpoint" in err
    code, _, err = cli(capsys, "checkpoint", "inspect", tmp_path / "nope")
    assert code == 2 and "no such checkpoint directory" in err


def test_export_bf16_loads_with_safetensors_alone(run, tmp_path):
    step = run / "checkpoints" / "step_00000004"
    res = moezero("checkpoint", "export", str(run / "checkpoints"), "--dtype", "bf16", "--out",
                  str(tmp_path / "hf"), timeout=60)
    assert res.returncode == 0, res.stderr
    exported = load_torch(str(tmp_path / "hf" / "model.safetensors"))
    master = {}
    for f in sorted(step.glob("model-*.safetensors")):  # no cap: whole tensors, plain files
        master.update(load_numpy(str(f)))
    assert exported.keys() == master.keys()
    assert {f"layers.0.moe.experts.{e}.w1.weight" for e in range(4)} <= exported.keys()
    for fqn, value in master.items():
        assert exported[fqn].dtype == torch.bfloat16
        assert torch.equal(exported[fqn], torch.from_numpy(value).to(torch.bfloat16)), fqn
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(master)
    assert index["metadata"]["total_size"] == 2 * sum(v.size for v in master.values())


def test_export_reassembles_fragments(tmp_path, capsys):
    cfg = ccfg(world=1, stage=2, max_group_size=700)  # cuts the 1536-element expert weights
    result = train_run(cfg, 1, saves=((1, str(tmp_path / "ck"), False),))
    step = tmp_path / "ck" / "step_00000001"
    keys = store.read_manifest(step).layout.model_files[0].tensors
    assert any("@" in t.key for f in store.read_manifest(step).layout.model_files
               for t in f.tensors), keys
    code, _, err = cli(capsys, "checkpoint", "export", step, "--out", tmp_path / "hf")
    assert code == 0, err
    exported = load_numpy(str(tmp_path / "hf" / "model.safetensors"))
    assert exported.keys() == result["params"].keys()
    for fqn, value in result["params"].items():
        assert np.array_equal(exported[fqn], value), fqn


# ---------------------------------------------------------------------------- crash safety
CRASH_TINY = [*TINY, "--set", "train.steps=400", "--set", "checkpoint.every=1",
              "--set", "checkpoint.keep_last=2"]


def _latest_step(root: Path) -> int | None:
    found = store.find_latest(root)
    return None if found is None else int(found.name.removeprefix("step_"))


def _wait_for_a_save(proc, root: Path, since: float, deadline: float) -> None:
    """Until this run (started at ``since``) has begun a save."""
    while True:
        for path in root.glob("step_*") if root.exists() else ():
            try:
                if path.stat().st_mtime >= since:
                    return
            except FileNotFoundError:  # removed by retention meanwhile
                pass
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.02)


def _ranks(launcher: int) -> list[int]:
    """The launcher's rank processes (not multiprocessing's resource tracker)."""
    ranks = []
    for pid in sorted(_children(launcher)):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.append(pid)
        except OSError:
            pass
    return ranks


def crash_chain(tmp_path: Path, points: int, seed: int) -> None:
    """``points`` runs, each resuming from ``latest`` and SIGKILLed at a random moment while
    it saves (a random rank, or every process); then one run that finishes. After every
    kill, ``latest`` names a checkpoint that verifies, and the next run resumes from it."""
    rng, out = random.Random(seed), tmp_path / "run"
    root = out / "checkpoints"
    previous, in_save = None, 0
    for point in range(points):
        load = ["--set", "checkpoint.load=latest"] if previous is not None else []
        mode = ["--set", f"checkpoint.async={'true' if point % 2 else 'false'}"]
        since = time.time() - 0.01
        proc = subprocess.Popen([*hooked(save_delay=0.03), "train", *CRASH_TINY,  # saves are
                                 *load, *mode, "--out", str(out)],  # most of the wall time
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        _wait_for_a_save(proc, root, since, time.monotonic() + 120)
        time.sleep(rng.uniform(0.0, 0.6))
        ranks = _ranks(proc.pid)
        in_save += any(root.glob("step_*.partial"))  # (racy, but only counted)
        if rng.random() < 0.25 or not ranks:
            os.killpg(proc.pid, signal.SIGKILL)  # every process at once
        else:
            os.kill(rng.choice(ranks), signal.SIGKILL)  # one rank; the launcher stops the rest
        output = proc.communicate(timeout=60)[0]
        assert proc.returncode != 0, output
        if previous is not None:
            assert f"resumed from {root / f'step_{previous:08d}'} at step {previous}" in output
        if not (root / "latest").exists():  # killed before its first `latest` was written
            assert previous is None
            found = store.find_latest(root)  # a step committed just before the kill, or none
            assert found is None or store.verify(found) == [], (point, found)
            previous = _latest_step(root)
            continue
        latest = root / (root / "latest").read_text()
        assert store.find_latest(root) == latest
        assert store.verify(latest) == [], (point, store.verify(latest))
        previous = _latest_step(root)
    assert points < 10 or in_save >= points // 4, f"only {in_save} kills landed in a save"
    final = (previous or 0) + 2
    load = ["--set", "checkpoint.load=latest"] if previous is not None else []
    res = moezero("train", *TINY, "--set", f"train.steps={final}", *load, "--out", str(out),
                  timeout=120)
    assert res.returncode == 0, res.stderr
    assert previous is None or f"at step {previous}" in res.stdout
    assert _latest_step(root) == final and store.verify(root / f"step_{final:08d}") == []
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, final + 1))  # redone steps replaced, none missing


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 15 s per point on 2 busy cores
def test_sigkill_at_twenty_points_never_breaks_latest(tmp_path):
    """CI runs this in the slow session; a three-point copy in the default session (four more
    CLI runs, about a minute of CI) asserted nothing this does not."""
    crash_chain(tmp_path, points=20, seed=2)
