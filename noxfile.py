"""Developer sessions: ``nox`` runs the whole suite (suite = tests + slow + parity in one venv,
lint, wheel; what CI runs). ``tests``, ``slow`` and ``parity`` also run alone. The tests that
start no processes run on one pytest-xdist worker per core, the others (marked ``spawns`` by
conftest.py) one at a time after them.

torch: on a machine without an NVIDIA GPU the sessions install the CPU build
``torch==2.13.0`` (``MOEZERO_TORCH`` overrides the requirement, e.g. ``torch`` on a GPU box);
the package itself only asks for ``torch>=2.4``, so users are never pinned.

Plain ``nox`` (the README's test command, what CI runs) also runs ``wheel``: the built
distribution, installed as users get it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path

import nox

nox.options.sessions = ["suite", "lint", "wheel"]
nox.options.reuse_existing_virtualenvs = True


def _torch_requirement() -> str:
    if "MOEZERO_TORCH" in os.environ:
        return os.environ["MOEZERO_TORCH"]
    return "torch" if shutil.which("nvidia-smi") else "torch==2.13.0"


def _install(session: nox.Session, extras: str = "dev") -> None:
    session.install(*shlex.split(_torch_requirement()))
    session.install("-e", f".[{extras}]")


def _workers() -> str:
    """pytest-xdist workers of a parallel pass: one per core (``MOEZERO_TEST_WORKERS``)."""
    return os.environ.get("MOEZERO_TEST_WORKERS", str(len(os.sched_getaffinity(0))))


def _parallel(session: nox.Session, path: str) -> None:
    """The tests under ``path`` without ``slow`` that start no processes, on one xdist worker
    per core, one torch thread each (conftest.py). Exit code 5 (nothing selected, e.g. with
    ``-- -k NAME``) is not a failure."""
    session.run("pytest", path, "-m", "not slow and not spawns", "-n", _workers(),
                *session.posargs, success_codes=[0, 5])


def _serial(session: nox.Session, paths: list[str], marker: str) -> None:
    """The tests that start processes (``spawns``: rank worlds, the CLI, torchrun), one at a
    time: a W=2 world already takes both cores, and its ranks have short timeouts."""
    session.run("pytest", *paths, "-m", marker, *session.posargs, success_codes=[0, 5])


@nox.session
def suite(session: nox.Session) -> None:
    """``tests``, ``slow`` and ``parity`` in one venv: one install of torch, the package and its
    extras instead of three (about a minute each on CI's 2-core box). The parallel passes of
    tests/ and parity_tests/ (kept apart: parity's conftest sets JAX's matmul precision for
    its process), then both suites' ``spawns`` and ``slow`` tests in one serial pass (nearly
    every slow test spawns; one pass collects once)."""
    _install(session, "dev,reference")
    _parallel(session, "tests")
    _parallel(session, "parity_tests")
    _serial(session, ["tests", "parity_tests"], "spawns or slow")


@nox.session
def tests(session: nox.Session) -> None:
    """Unit and multi-process tests of each side (tests/), without the slow marker."""
    _install(session, "dev,reference")
    _parallel(session, "tests")
    _serial(session, ["tests"], "not slow and spawns")


@nox.session
def slow(session: nox.Session) -> None:
    """The slow multi-process cases (marked ``slow``)."""
    _install(session, "dev,reference")
    _serial(session, ["tests", "parity_tests"], "slow")


@nox.session
def parity(session: nox.Session) -> None:
    """torch vs the JAX reference (installs the ``reference`` extra)."""
    _install(session, "dev,reference")
    _parallel(session, "parity_tests")
    _serial(session, ["parity_tests"], "not slow and spawns")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, the import-layering contracts, and the production install without JAX."""
    session.install(*shlex.split(_torch_requirement()))
    session.install(".", "ruff", "import-linter", "pytest")
    session.run("ruff", "check", ".")
    session.run("lint-imports")
    session.run("python", "-c", "import importlib.util as u, sys; "
                "sys.exit('jax is installed: this check needs a venv without it' "
                "if u.find_spec('jax') else 0)")
    # -I: the repository root is not on sys.path, so this sees the installed distribution only
    session.run("python", "-I", "-c", "import importlib.util as u, sys, moezero; "
                "bad = [n for n in ('torch_impl', 'reference') if u.find_spec(n)]; "
                "sys.exit(f'installed top-level modules besides moezero: {bad}' if bad else 0); ")
    session.run("python", "-I", "-c", "import moezero, moezero.engine, moezero.cli; "
                "moezero.initialize; moezero.MoE; moezero.load_config; "
                "import sys; assert 'jax' not in sys.modules; print('moezero imports without JAX')")


@nox.session(reuse_venv=False)  # a fresh venv every run: no stale install
def wheel(session: nox.Session) -> None:
    """The distribution as users get it: build the sdist and the wheel (from the sdist),
    ``twine check`` both, hold them to the source tree (tests/wheel/check_wheel.py: every
    subpackage, recipe and doc page, nothing stray), install the wheel (not ``-e``) with torch
    and only the ``hf`` extra into this fresh venv, and run every subcommand from a
    temporary folder outside the repository, then the README's fine-tune example as written
    (tests/wheel/smoke.py: 73 s on 2 idle cores, 220 s under load, before the fine-tune
    example; with it, 336 s on 2 cores shared with other jobs, of which the example 87 s).
    """
    dist = Path(session.create_tmp(), "dist")
    shutil.rmtree(dist, ignore_errors=True)
    session.install("build", "twine")
    session.run("python", "-m", "build", "--outdir", str(dist), ".")
    artifacts = sorted(str(p) for p in dist.iterdir())
    session.run("python", "-m", "twine", "check", "--strict", *artifacts)
    session.run("python", "tests/wheel/check_wheel.py", *artifacts)
    session.install(*shlex.split(_torch_requirement()))
    session.install(f"{next(dist.glob('*.whl'))}[hf]")  # all the README's fine-tune needs
    smoke = str(Path("tests/wheel/smoke.py").resolve())
    with tempfile.TemporaryDirectory(prefix="moezero-wheel-") as work:
        session.chdir(work)
        session.run("python", "-I", smoke)


@nox.session
def train(session: nox.Session) -> None:
    """Install and train the embedded default (the README's first command, in a venv)."""
    session.install(*shlex.split(_torch_requirement()))
    session.install(".")
    session.run("moezero", "train", *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """The first session on a lent GPU in one command: ``python -m benchmarks.gpu --check``
    (``-- --smoke`` on CPU). Installs what the check needs: ``MOEZERO_TORCH`` (the CUDA build
    of torch, e.g. ``torch --index-url https://download.pytorch.org/whl/cu128``; on a machine
    with ``nvidia-smi`` plain ``torch``), and the extras the ``gpu``-marked tests it collects
    import (``dev``: transformers, peft; ``reference``: JAX, whose suite is otherwise skipped
    with its reason; ``data``)."""
    _install(session, "dev,reference,data")
    session.run("python", "-m", "benchmarks.gpu", "--check", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks side by side with peers; writes BENCHMARKS.md (``-- --quick`` for a short run).

    ``-- --quick`` takes under 10 minutes on 2 cores; ``-- --series NAME`` reruns one table's
    series (main, sweep, tiled, state, ckpt, grouped, data, collectives; see
    ``benchmarks/specs.py``); a run of only grouped, data, tiled or collectives rewrites only
    their sections of BENCHMARKS.md. The GPU benchmark is ``python -m benchmarks.gpu`` on a GPU
    machine (not part of this session).

    moezero (and FSDP2, part of torch) run in this session's venv. DeepSpeed gets its own venv,
    ``MOEZERO_PEER_VENV`` (default ``.nox/bench-peers``), so its dependencies never change the
    environment moezero is measured in; this tree is installed there with ``--no-deps`` (the
    peer builds the same model from ``moezero.model``), so moezero's never change the peer's.
    A failed DeepSpeed install is reported in BENCHMARKS.md
    with its error line; the other rows still run.
    """
    from pathlib import Path

    _install(session, "dev")
    args = session.posargs
    series = [b for a, b in zip(args[:-1], args[1:], strict=True) if a == "--series"]
    if series == ["data"]:  # moezero and the tokenizer only: no peer venv needed
        session.run("python", "-m", "benchmarks.run", *session.posargs)
        return
    venv = Path(os.environ.get("MOEZERO_PEER_VENV", ".nox/bench-peers")).resolve()
    log_path = Path("bench_out", "peer-install.log")
    log_path.parent.mkdir(exist_ok=True)
    note = ""
    with open(log_path, "w") as log:
        try:
            if not (venv / "bin" / "python").exists():
                session.run("python", "-m", "venv", str(venv), stdout=log)
            pip = str(venv / "bin" / "pip")
            # ninja: DeepSpeedCPUAdam's cpu_adam op is built at first use (hoststep series)
            session.run(pip, "install", *shlex.split(_torch_requirement()), "wheel", "ninja",
                        external=True, stdout=log)
            session.run(pip, "install", "--no-build-isolation", "deepspeed==0.19.8",
                        env={"DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"}, external=True,
                        stdout=log)
            # benchmarks/deepspeed_scale.py: the model classes (AutoEP's Mixtral preset needs 5.x);
            # accelerate for transformers' ZeRO-3 construction (HfDeepSpeedConfig)
            session.run(pip, "install", "transformers>=5.0", "accelerate>=1.1", external=True, stdout=log)
            # benchmarks/finetune_peer.py: the finetune series' peer (TRL SFTTrainer + PEFT LoRA)
            session.run(pip, "install", "trl==1.16.0", "peft==0.21.2", external=True, stdout=log)
            # the peer trainer builds the same model from moezero.model (and the data from
            # moezero.data): this tree, without its dependencies, so the peer's environment
            # stays DeepSpeed's (those modules import torch, numpy and tqdm, all DeepSpeed's)
            session.run(pip, "install", "--no-deps", "--force-reinstall", ".", external=True,
                        stdout=log)
        except nox.command.CommandFailed as exc:
            lines = [ln.strip() for ln in log_path.read_text().splitlines() if ln.strip()]
            errors = [ln for ln in lines if "error" in ln.lower()] or lines or [str(exc.reason)]
            note = f"DeepSpeed install failed (see {log_path}): {errors[-1]}"
            session.warn(note)
    peer = ["--peer-python", str(venv / "bin" / "python")] + (["--peer-note", note] if note else [])
    session.run("python", "-m", "benchmarks.run", *peer, *session.posargs)


DEEPSPEED = ("deepspeed==0.19.8", "transformers>=5.0", "accelerate", "safetensors")
"""The DeepSpeed the fixtures of ``import-deepspeed`` were made with (tests/fixtures/deepspeed)."""


@nox.session
def deepspeed_fixtures(session: nox.Session) -> None:
    """Slow, not in the default sessions: re-create tests/fixtures/deepspeed with the real
    DeepSpeed (in this session's own venv, on CPU with gloo), then check ``import-deepspeed``
    against them (``deepspeed_check``, moezero's venv). A DeepSpeed format change fails here.
    The NVMe case (not committed: 14 MB) needs ``libaio-dev``; DeepSpeed JIT-builds its
    async_io op on first use (minutes)."""
    env = {"DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"}
    session.install("torch==2.13.0", "wheel")
    session.install("--no-build-isolation", DEEPSPEED[0], env=env)
    session.install(*DEEPSPEED[1:])
    script = "tests/fixtures/deepspeed/make_fixtures.py"
    out = os.path.join(session.create_tmp(), "deepspeed_fixtures")
    cases = session.run("python", script, "--cases", silent=True, env=env)
    for case, world in json.loads(cases.strip().splitlines()[-1]).items():
        session.run("torchrun", "--nproc_per_node", str(world), "--master_port", "29650",
                    script, case, out, env=env)
    session.notify("deepspeed_check", [out])


@nox.session
def deepspeed_check(session: nox.Session) -> None:
    """The importer tests against the fixtures folder given as the argument (default: the
    committed ones)."""
    _install(session, "dev")
    env = {"MOEZERO_DS_FIXTURES": session.posargs[0]} if session.posargs else {}
    session.run("pytest", "tests/torch_impl/test_deepspeed_import.py",
                "tests/torch_impl/test_deepspeed_families.py", env=env)
