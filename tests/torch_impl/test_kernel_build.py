"""Building the host AdamW kernel beside other jobs (torch_impl/zero/kernel_cache.py).

torch's extension builder marks a build in progress with a ``lock`` file in the build folder
and waits, forever, while that file exists; a process killed while building (a preempted
job, an OOM kill) leaves it behind, and every later run on the machine used to hang at its
first optimizer step. moezero's builders take an OS lock first (released by the kernel when
a process dies), so a ``lock`` file found while holding it is stale and is removed.

The source here is a minimal Python module (no torch headers): it builds in about a second.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

MODULE = textwrap.dedent("""\
    #include <Python.h>
    #define MZ_STR2(x) #x
    #define MZ_STR(x) MZ_STR2(x)
    #define MZ_CAT2(a, b) a##b
    #define MZ_CAT(a, b) MZ_CAT2(a, b)
    static struct PyModuleDef mz_def = {PyModuleDef_HEAD_INIT, MZ_STR(TORCH_EXTENSION_NAME),
                                        nullptr, -1, nullptr};
    PyMODINIT_FUNC MZ_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&mz_def); }
    """)

LOAD = textwrap.dedent("""\
    import sys
    from pathlib import Path
    from moezero.zero import hostadam, kernel_cache
    source = Path(sys.argv[1])
    if sys.argv[2] == "stale":
        name = f"moezero_{source.stem}_{hostadam._cpu_tag()}"
        kernel_cache.build_dir(name).mkdir(parents=True)
        (kernel_cache.build_dir(name) / "lock").touch()
    module, why = hostadam.load_compiled(source)
    print("loaded" if module is not None else f"failed: {why}")
    """)


def load_in_child(tmp_path, mode: str) -> subprocess.CompletedProcess:
    source = tmp_path / "mzkernel.cpp"
    source.write_text(MODULE)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    return subprocess.run([sys.executable, "-c", LOAD, str(source), mode], env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_stale_build_lock_of_a_killed_build_is_cleared(tmp_path):
    try:
        res = load_in_child(tmp_path, "stale")
    except subprocess.TimeoutExpired:
        raise AssertionError("load_compiled hung on the lock file a killed build left") from None
    assert res.stdout.strip() == "loaded", res.stderr[-2000:]
    assert "stale" in res.stderr, res.stderr[-2000:]  # said, as a warning


def test_a_second_process_imports_the_build_of_the_first(tmp_path):
    assert load_in_child(tmp_path, "fresh").stdout.strip() == "loaded"
    second = load_in_child(tmp_path, "again")
    assert second.stdout.strip() == "loaded", second.stderr[-2000:]


SLOW_CXX = textwrap.dedent("""\
    #!/bin/sh
    # a compiler whose compiles take 4 s more and are logged (torch's version checks pass through)
    case " $* " in
    *" -c "*) echo "start $$" >> "$MZ_CC_LOG"; sleep 4; c++ "$@"; rc=$?
              echo "done $$" >> "$MZ_CC_LOG"; exit $rc;;
    esac
    exec c++ "$@"
    """)


def test_a_killed_builders_compiler_never_compiles_beside_the_next_build(tmp_path):
    """issue 38 #13: a builder killed mid-compile (SIGKILL, as the OOM killer or a launcher's
    kill does): its compile must not run beside the next process's, and that process must not
    warn of a stale build lock (its build finished or was stopped with its builder); a later
    fresh build (another source) warns of nothing either."""
    source = tmp_path / "mzkernel.cpp"
    source.write_text(MODULE)
    (tmp_path / "slowcc").write_text(SLOW_CXX)
    (tmp_path / "slowcc").chmod(0o755)
    log = tmp_path / "cc.log"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "CXX": str(tmp_path / "slowcc"), "MZ_CC_LOG": str(log)}
    first = subprocess.Popen([sys.executable, "-c", LOAD, str(source), "fresh"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (log.exists() and "start" in log.read_text()):
        assert first.poll() is None and time.monotonic() < deadline, "no compile started"
        time.sleep(0.05)
    first.kill()
    first.wait()
    second = subprocess.run([sys.executable, "-c", LOAD, str(source), "again"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert second.stdout.strip() == "loaded", second.stderr[-2000:]
    assert "stale" not in second.stderr, second.stderr[-2000:]
    time.sleep(5)  # a compile the kill left running would log its end by now
    running = 0
    for event in log.read_text().split():
        running += {"start": 1, "done": -1}.get(event, 0)
        assert running <= 1, log.read_text()  # never two compiles at once
    source.write_text(MODULE + "// another source: a fresh build\n")
    third = subprocess.run([sys.executable, "-c", LOAD, str(source), "again"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert third.stdout.strip() == "loaded", third.stderr[-2000:]
    assert "stale" not in third.stderr, third.stderr[-2000:]
