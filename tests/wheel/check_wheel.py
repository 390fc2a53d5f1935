"""The built distribution against the source tree (``nox -s wheel``; not a pytest module).

    python tests/wheel/check_wheel.py dist/moezero-X-py3-none-any.whl dist/moezero-X.tar.gz

The wheel must hold, under its installed name, every module of every package of the source
tree (each folder with an ``__init__.py`` under ``torch_impl/`` and ``reference/``) and the
recipes (``torch_impl/recipes/*.yaml``), the host AdamW kernel's source
(``torch_impl/zero/csrc/*.cpp``) and the documentation pages (``docs/*.md`` as
``moezero/docs/``), and nothing else beside its ``.dist-info``: no
``moezero/reference/plan`` copy of ``moezero.plan``, no tests, no benchmarks. The sdist must
hold what builds the wheel (pyproject.toml, setup.py, README.md, LICENSE). Exit 1 with one
line per missing or stray file; exit 0 with one summary line.
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# source folder -> installed name, the longest folder first (reference/plan is moezero/plan)
ROOTS = (("reference/plan", "moezero/plan"), ("torch_impl", "moezero"),
         ("reference", "moezero/reference"), ("docs", "moezero/docs"))
DATA = ("torch_impl/recipes/*.yaml", "torch_impl/zero/csrc/*.cpp",
        "docs/*.md")  # pyproject package-data
SDIST_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE")


def installed_name(source: str) -> str:
    """``torch_impl/checkpoint/hf/arch.py`` -> ``moezero/checkpoint/hf/arch.py``."""
    for folder, name in ROOTS:
        if source.startswith(folder + "/"):
            return name + source[len(folder):]
    raise ValueError(f"{source} is outside {[f for f, _ in ROOTS]}")


def source_files(repo: Path) -> dict[str, str]:
    """{installed name: source path} of the modules of every package, and the data files."""
    found = []
    for folder, _ in ROOTS:
        for init in (repo / folder).rglob("__init__.py"):
            found += init.parent.glob("*.py")
    for pattern in DATA:
        found += repo.glob(pattern)
    sources = {p.relative_to(repo).as_posix() for p in found}
    return {installed_name(s): s for s in sorted(sources)}


def wheel_problems(names: Iterable[str], repo: Path) -> list[str]:
    """One line per source file the wheel lacks and per wheel file no source file explains."""
    names = [n for n in names if not n.endswith("/")]
    expected = source_files(repo)
    problems = [f"missing from the wheel: {name} (from {source})"
                for name, source in expected.items() if name not in names]
    stray = [n for n in names if n not in expected and ".dist-info/" not in n]
    problems += [f"in the wheel but not in the source tree: {n}" for n in stray]
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        problems.append("missing from the wheel: .dist-info/licenses/LICENSE")
    return problems


def sdist_problems(names: Iterable[str]) -> list[str]:
    tops = {n.split("/", 1)[1] for n in names if "/" in n}
    return [f"missing from the sdist: {f}" for f in SDIST_FILES if f not in tops]


def main(paths: list[str]) -> int:
    problems = []
    for path in paths:
        if path.endswith(".whl"):
            with zipfile.ZipFile(path) as whl:
                found = wheel_problems(whl.namelist(), REPO)
        else:
            with tarfile.open(path) as sdist:
                found = sdist_problems(sdist.getnames())
        problems += [f"{Path(path).name}: {p}" for p in found]
    for line in problems:
        print(line)
    if problems:
        return 1
    print(f"{len(source_files(REPO))} source files, each in the wheel once; "
          f"{', '.join(Path(p).name for p in paths)}: nothing missing or stray")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
