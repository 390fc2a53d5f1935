"""The import contracts of pyproject.toml (docs/design.md, "Who imports whom") can fail.

``nox -s lint`` runs ``lint-imports`` on the installed package; a contract that a forbidden
import does not break would pass there forever. So this test lays the package out as it is
installed (``torch_impl/`` as ``moezero``, ``reference/plan/`` as ``moezero.plan``,
``reference/`` as ``moezero.reference``: setup.py's mapping) in a temporary folder, checks that
import-linter keeps every contract on the copy, then plants the forbidden imports in one copy and
sees each contract that forbids one broken, naming it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is not installed (the dev extra)")

ROOT = Path(__file__).resolve().parent.parent
# -I: neither the repository nor an editable install's path entries come before the copy
LINT = """import importlib.util, sys
sys.path.insert(0, {site!r})
origin = importlib.util.find_spec("moezero").origin
assert origin.startswith({site!r}), f"moezero found at {{origin}}, not in the copy"
from importlinter.cli import lint_imports_command
sys.argv = ["lint-imports", "--no-cache"]
lint_imports_command()
"""


def installed_copy(dest: Path) -> Path:
    """The package laid out under ``dest/site`` as installed, beside a copy of pyproject.toml
    (import-linter's configuration, read from the folder it runs in)."""
    site, skip = dest / "site", shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "torch_impl", site / "moezero", ignore=skip)
    shutil.copytree(ROOT / "reference" / "plan", site / "moezero" / "plan", ignore=skip)
    top = str(ROOT / "reference")  # its plan folder is moezero.plan, not moezero.reference.plan
    shutil.copytree(ROOT / "reference", site / "moezero" / "reference",
                    ignore=lambda d, names: [*skip(d, names), *(["plan"] if d == top else [])])
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return site


def lint(dest: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-c", LINT.format(site=str(site))], cwd=dest,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> tuple[Path, Path]:
    dest = tmp_path_factory.mktemp("contracts")
    return dest, installed_copy(dest)


def test_the_installed_layout_keeps_every_contract(copy):
    done = lint(*copy)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert " 0 broken" in done.stdout


# (module, planted import, the import line a broken contract reports, the contracts it breaks)
PLANTS = [
    ("checkpoint/options.py", "import moezero.zero.groups",
     "moezero.checkpoint.options -> moezero.zero.groups",
     ("checkpoint never imports zero", "torch-side subpackages point one way")),
    ("offload/options.py", "import moezero.zero.shards",  # checkpoint imports offload
     "moezero.offload.options -> moezero.zero.shards",
     ("checkpoint never imports zero", "torch-side subpackages point one way")),
    ("telemetry.py", "import moezero.engine", "moezero.telemetry -> moezero.engine",
     ("telemetry observes the model and the process, never the engine",
      "torch-side subpackages point one way")),
]


def broken_sections(report: str, names: list[str]) -> dict[str, str]:
    """Each broken contract's section of the report's "Broken contracts" part, by the part of
    its name given in ``names``."""
    part = report.split("Broken contracts", 1)[1]
    starts = sorted((part.index(n), n) for n in names if n in part)
    ends = [s for s, _ in starts[1:]] + [len(part)]
    return {n: part[s:e] for (s, n), e in zip(starts, ends, strict=True)}


def test_each_planted_import_breaks_its_contracts(copy, tmp_path):
    """Every import of ``PLANTS`` planted in one copy (one lint run for all, CI time): each
    contract that forbids one is broken, and its section of the report names that import (so
    no plant passes on the strength of another)."""
    dest, site = copy
    planted_site = tmp_path / "site"
    shutil.copytree(site, planted_site)
    shutil.copy(dest / "pyproject.toml", tmp_path / "pyproject.toml")
    for module, planted, _, _ in PLANTS:
        path = planted_site / "moezero" / module
        path.write_text(path.read_text() + f"\n{planted}  # planted by the test\n")
    done = lint(tmp_path, planted_site)
    assert done.returncode != 0, done.stdout[-2000:]
    report = " ".join(done.stdout.split())  # long contract names wrap over lines
    sections = broken_sections(report, sorted({c for *_, cs in PLANTS for c in cs}))
    for _, _, line, contracts in PLANTS:
        for contract in contracts:
            assert f"{contract} BROKEN" in report, done.stdout[-3000:]
            assert line in sections[contract], (line, contract, done.stdout[-3000:])
