"""Which tests start processes: the ``spawns`` marker the root conftest adds at collection, and
the check that catches a test it missed.

CI runs the suite in two passes (noxfile.py): the tests without ``spawns`` on one pytest-xdist
worker per core (each worker computes on one thread), then the ``spawns`` tests one at a time,
since a W=2 world already takes both cores and its ranks have short timeouts.

A test spawns when the code it runs, followed by name through its own module and the shared
test helpers (its function, its fixtures, the module-level functions and classes those name),
names a way to start a process: ``run_world``, the launcher's ``spawn``, ``subprocess``,
``multiprocessing``, torchrun, or the CLI's in-process ``main(["train", ...])`` (W defaults to
2). The rule errs towards ``spawns`` (a serial test is only slower); a test it misses is named
at the end of the parallel pass by ``ChildTime`` (the CPU time of the processes it waited for).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import types

from tests.support.ranks import RankTime

SPAWNING_NAMES = frozenset({"run_world", "start_world", "spawn", "start_processes", "subprocess",
                            "Popen", "multiprocessing", "torchrun", "launch_training",
                            "peak_growth"})
"""A name in a test's reachable code that means it starts processes (``peak_growth``:
tests/support/peak.py runs a script in a subprocess)."""

LOCAL_PACKAGES = ("tests", "parity_tests", "benchmarks")
"""Modules whose functions the rule follows (the production package is not followed: the
CLI's ``main`` is recognised by its ``"train"`` argument instead; a test whose process-starting
happens deeper in moezero carries ``@pytest.mark.spawns`` itself)."""


def _codes(code: types.CodeType):
    """``code`` and every code object nested in it (inner functions, lambdas, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _functions(obj) -> list:
    """The functions behind ``obj``: itself, a class's methods, a fixture's or partial's target."""
    obj = getattr(obj, "_fixture_function", getattr(obj, "__wrapped__", obj))
    obj = getattr(obj, "func", obj) if not inspect.isfunction(obj) else obj
    if inspect.isclass(obj):
        return [f for f in vars(obj).values() if inspect.isfunction(f)]
    return [obj] if inspect.isfunction(obj) else []


def _local(obj) -> bool:
    return getattr(obj, "__module__", "").split(".")[0] in LOCAL_PACKAGES


def _spawns_in(fn, seen: set) -> bool:
    if fn in seen:
        return False
    seen.add(fn)
    for code in _codes(fn.__code__):
        names = set(code.co_names)
        if "getfixturevalue" in names:  # a fixture named at run time: any of the module's
            names |= {n for n, v in fn.__globals__.items() if _local(v)}
        strings = {c for c in code.co_consts if isinstance(c, str)}
        if names & SPAWNING_NAMES or "torchrun" in strings or ("main" in names and "train" in strings):
            return True
        for target in _targets(fn.__globals__, names):
            if any(_spawns_in(f, seen) for f in _functions(target)):
                return True
    return False


def _local_module(name: str) -> types.ModuleType | None:
    if name.split(".")[0] not in LOCAL_PACKAGES:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _targets(scope: dict, names: set) -> list:
    """The local functions and classes ``names`` may mean in ``scope``: its globals, and
    attributes of the local modules it imported, at its top (``kill_launcher.main``) or in the
    function (``from tests.torch_impl.test_preemption import _start``)."""
    modules = [v for v in scope.values() if isinstance(v, types.ModuleType)]
    modules += [m for m in map(_local_module, names) if m is not None]
    modules = [m for m in modules if m.__name__.split(".")[0] in LOCAL_PACKAGES]
    modules += [v for m in modules for v in vars(m).values() if isinstance(v, types.ModuleType)
                and v.__name__.split(".")[0] in LOCAL_PACKAGES]  # from tests.support import world
    found = [scope.get(n) for n in names]
    found += [getattr(m, n, None) for m in modules for n in names]
    return [t for t in found if t is not None and _local(t)]


def item_spawns(item) -> bool:
    """Whether the test ``item``, its fixtures or a callable parameter start processes."""
    roots = list(_functions(getattr(item, "function", None)))
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        for fixturedef in defs:
            if _local(fixturedef.func):
                roots += _functions(fixturedef.func)
    callspec = getattr(item, "callspec", None)
    for value in (callspec.params.values() if callspec else ()):
        if callable(value) and _local(value):
            roots += _functions(value)
    return any(map(_root_spawns, roots))


@functools.cache
def _root_spawns(fn) -> bool:
    """``_spawns_in`` from ``fn`` alone: shared by a test's parameters and a module's tests."""
    return _spawns_in(fn, set())


class ChildTime:
    """The CPU seconds of waited-for child processes (and theirs) and of the ranks forked for
    ``run_world`` (``RankTime``: not our children) during each test of a pass that should have
    none: tests over ``threshold_s`` are listed at the end of the run. Time spent in session
    fixtures (a one-time kernel build) is ``excuse``d."""

    def __init__(self, threshold_s: float = 2.0):
        self.threshold_s = threshold_s
        self.start = 0.0
        self.excused = 0.0
        self.missed: dict[str, float] = {}

    @staticmethod
    def now() -> float:
        times = os.times()
        return times.children_user + times.children_system + RankTime.seconds

    def excuse(self, seconds: float) -> None:
        self.excused += seconds

    def begin(self) -> None:
        self.start, self.excused = self.now(), 0.0

    def end(self, nodeid: str) -> None:
        used = self.now() - self.start - self.excused
        if used > self.threshold_s:
            self.missed[nodeid] = used
