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
