"""Setup shared by every suite (tests/ and parity_tests/): the ``spawns`` marker and, on a
pytest-xdist worker, one compute thread.

CI (noxfile.py) runs each suite in two passes: ``-m 'not spawns' -n <cores>``, one worker per
core, then ``-m spawns`` one test at a time (a W=2 world already takes both cores, and its
ranks have short timeouts). ``tests/support/spawns.py`` says which tests spawn. Plain
``pytest`` (no ``-n``) runs everything in one process, as before.

On a worker, torch computes on one thread (``torch.set_num_threads(1)`` and ``OMP_NUM_THREADS``
/ ``MKL_NUM_THREADS`` for the processes a test starts), so the workers do not oversubscribe
the cores. No test's asserted numbers depend on the thread count: each compares runs made
in the same process, or with tolerances.
"""

from __future__ import annotations

import os

import pytest

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:  # before torch is imported: OpenMP reads these once
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"

from tests.support.spawns import ChildTime, item_spawns  # noqa: E402

_CHILD_TIME = ChildTime()


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "spawns: starts processes (rank worlds, the CLI, torchrun); added by the "
        "root conftest, run after the parallel pass one at a time")
    if WORKER:
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if item_spawns(item):
            item.add_marker(pytest.mark.spawns)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Child CPU time of a session fixture (a one-time kernel build) is nobody's test's."""
    before = _CHILD_TIME.now()
    try:
        return (yield)
    finally:
        if WORKER and fixturedef.scope == "session":
            _CHILD_TIME.excuse(_CHILD_TIME.now() - before)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not WORKER:
        return (yield)
    _CHILD_TIME.begin()
    try:
        return (yield)
    finally:
        _CHILD_TIME.end(item.nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """On the controller: what each worker's tests spawned though not marked ``spawns``."""
    node.config._spawns_missed = {**getattr(node.config, "_spawns_missed", {}),
                                  **node.workeroutput.get("spawns_missed", {})}


def pytest_sessionfinish(session) -> None:
    if WORKER:
        session.config.workeroutput["spawns_missed"] = dict(_CHILD_TIME.missed)


def pytest_terminal_summary(terminalreporter, config) -> None:
    missed = getattr(config, "_spawns_missed", {})
    for nodeid, seconds in sorted(missed.items()):
        terminalreporter.write_line(
            f"SPAWNED {nodeid}: its child processes used {seconds:.1f} s of CPU in the parallel "
            "pass; make tests/support/spawns.py mark it 'spawns'", yellow=True)
