"""Loading an already-built extension without importing ``torch.utils.cpp_extension``.

``torch.utils.cpp_extension.load`` checks a build (and builds) with ninja, but importing it
imports setuptools, distutils and pkg_resources: about 11 MiB of anonymous memory in every
rank (BENCHMARKS.md, "Where the main table's memory goes") to find out, almost always, that
the library built last time is current. After a build, ``record`` writes a stamp beside the
library (the source's digest, the flags, torch's version and the library's size and
modification time); ``find`` returns the library when that stamp matches what would be built
now, so ``hostadam.load_compiled`` imports it directly and calls ``load`` only otherwise
(first use, another source or flags, another process rebuilding it).

Builders take ``exclusive`` first: an OS lock on ``moezero.lock`` in the build folder, which
the kernel releases when its holder dies. torch's own ``lock`` file, which ``load`` waits on
for as long as it exists, is left behind by a process killed mid-build (a preemption, an OOM
kill), and every later run would hang at its first step; found under ``exclusive``, no
moezero build holds it, so it is stale and removed (with a warning).

``build`` runs ``load`` in a child process of its own session (``python -m
moezero.zero.kernel_cache``), which holds the OS lock too (the descriptor is passed to it), and
stamps the library. The compiler and ninja are in the child's process group. A builder killed
mid-build (SIGKILL: nothing of it runs again) leaves the child to finish the build: the next
builder waits on the lock the child still holds, then imports the finished build, so no two
compiles of one kernel ever run side by side (a killed builder's compiler used to go on beside
the next build, which then warned of a stale lock). A child that dies (an OOM kill) has its
process group killed and its ``lock`` file removed by the builder, who knows it is stale.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

STAMP = "moezero-build.json"

log = logging.getLogger(__name__)


def build_dir(name: str) -> Path:
    """The folder ``torch.utils.cpp_extension.load`` builds ``name`` in (its rule, torch 2.x:
    ``TORCH_EXTENSIONS_DIR``, else the user cache's ``torch_extensions/py3XY_<accelerator>``)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch._appdirs import user_cache_dir

        if torch.version.hip is not None:
            accel = "rocm" + torch.version.hip.replace(".", "")
        elif torch.version.cuda is not None:
            accel = "cu" + torch.version.cuda.replace(".", "")
        else:
            accel = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(user_cache_dir(appname="torch_extensions")),
                            f"{python}_{accel}")
    return Path(root) / name


def _stamp(library: Path, source: Path, cflags: list[str]) -> dict:
    st = library.stat()
    return {"source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(), "cflags": cflags,
            "torch": torch.__version__, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def find(name: str, source: Path, cflags: list[str]) -> Path | None:
    """The library built as ``name`` from ``source`` with ``cflags``, if its stamp says so and
    no build is under way (torch's ``lock`` file); else None."""
    folder = build_dir(name)
    library = folder / f"{name}.so"
    try:
        if (folder / "lock").exists():
            return None
        recorded = json.loads((folder / STAMP).read_text())
        return library if recorded == _stamp(library, source, cflags) else None
    except (OSError, ValueError):
        return None


def record(library: str | os.PathLike, source: Path, cflags: list[str]) -> None:
    """Stamp a library ``load`` just built or checked (atomically; a failure only means the
    next process calls ``load`` again)."""
    library = Path(library)
    tmp = library.parent / f".{STAMP}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(_stamp(library, source, cflags)))
        os.replace(tmp, library.parent / STAMP)
    except OSError:
        tmp.unlink(missing_ok=True)


def import_library(name: str, library: Path):
    """The extension module in ``library`` (what ``load`` returns for a Python module)."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def exclusive(name: str):
    """Hold the build of ``name`` against other moezero processes (blocks while one builds);
    a torch ``lock`` file found meanwhile is a killed build's and is removed. Yields the open
    lock file (``build`` passes it to its child)."""
    folder = build_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "moezero.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = folder / "lock"
        if stale.exists():
            log.warning("removing %s: a stale build lock (the process building %s died)",
                        stale, name)
            stale.unlink(missing_ok=True)
        yield held


def build(name: str, source: Path, cflags: list[str], held) -> Path:
    """Build ``source`` as ``name`` in a child of its own session that holds ``held`` (the
    ``exclusive`` lock) too, and return the stamped library; RuntimeError naming the build's
    last error line when it fails."""
    child = subprocess.Popen([sys.executable, "-m", "moezero.zero.kernel_cache", name,
                              str(source), *cflags], start_new_session=True,
                             pass_fds=(held.fileno(),), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        _, err = child.communicate()
    finally:  # a builder leaving early (an exception; SIGKILL runs nothing) stops its build
        _stop_group(child, build_dir(name) / "lock")
    library = find(name, source, cflags)
    if child.returncode != 0 or library is None:
        lines = [ln for ln in (err or "").splitlines() if ln.strip()]
        raise RuntimeError(lines[-1] if lines else f"the build exited with {child.returncode}")
    return library


def _stop_group(child: subprocess.Popen, torch_lock: Path) -> None:
    """Kill what is left of the child's process group (its compilers, when the child died or
    the builder leaves early) and remove the ``lock`` file of a child that did not finish."""
    if child.returncode == 0:  # finished: ninja waited for its compilers
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    if child.wait() < 0:  # killed: torch's lock is its, and stale
        torch_lock.unlink(missing_ok=True)


def _child(name: str, source: str, cflags: list[str]) -> None:
    """The build child: torch's ``load`` builds (or checks) the library; the stamp follows."""
    _ninja_on_path()
    from torch.utils.cpp_extension import load

    module = load(name=name, sources=[source], extra_cflags=cflags, verbose=False)
    record(module.__file__, Path(source), cflags)


def _ninja_on_path() -> None:
    """torch's extension builder runs ``ninja`` from PATH; the ``ninja`` package moezero depends
    on puts it in its own folder, which a venv's PATH lacks unless the venv is activated (set
    in the build child only)."""
    try:
        import ninja
    except ImportError:
        return
    folder = getattr(ninja, "BIN_DIR", None)
    if folder and folder not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, (folder, os.environ.get("PATH"))))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3:])
