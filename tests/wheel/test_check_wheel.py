"""tests/wheel/check_wheel.py, the wheel-against-source-tree check of ``nox -s wheel``, on
wheels written here: it names a subpackage the build left out (issue 25: the hand-written
package list missed ``moezero.checkpoint.hf``), a missing recipe, a stray copy of the plan
inside ``moezero.reference``, tests in the wheel, and an sdist without its LICENSE.
"""

from __future__ import annotations

import io
import tarfile
import zipfile

import pytest

from tests.wheel.check_wheel import REPO, main, source_files

LICENSE = "moezero-0.1.0.dist-info/licenses/LICENSE"


def write_wheel(path, names) -> str:
    with zipfile.ZipFile(path, "w") as whl:
        for name in names:
            whl.writestr(name, "")
    return str(path)


def write_sdist(path, names) -> str:
    with tarfile.open(path, "w:gz") as sdist:
        for name in names:
            sdist.addfile(tarfile.TarInfo(f"moezero-0.1.0/{name}"), io.BytesIO(b""))
    return str(path)


@pytest.fixture
def complete() -> list[str]:
    return [*source_files(REPO), LICENSE]


def test_the_source_tree_maps_to_installed_names():
    names = source_files(REPO)
    assert names["moezero/checkpoint/hf/__init__.py"] == "torch_impl/checkpoint/hf/__init__.py"
    assert names["moezero/plan/store.py"] == "reference/plan/store.py"
    assert names["moezero/reference/sharded.py"] == "reference/sharded.py"
    assert names["moezero/recipes/default.yaml"] == "torch_impl/recipes/default.yaml"
    assert not [n for n in names if n.startswith("moezero/reference/plan/")]


def test_a_complete_wheel_passes(tmp_path, complete, capsys):
    assert main([write_wheel(tmp_path / "m.whl", complete)]) == 0
    assert "nothing missing or stray" in capsys.readouterr().out


@pytest.mark.parametrize("left_out", ["moezero/checkpoint/hf/", "moezero/recipes/", LICENSE])
def test_a_missing_subpackage_or_file_is_named(tmp_path, complete, capsys, left_out):
    names = [n for n in complete if not n.startswith(left_out)]
    assert main([write_wheel(tmp_path / "m.whl", names)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out and all(": missing from the wheel: " in line for line in out), out
    if left_out == "moezero/checkpoint/hf/":
        assert ("m.whl: missing from the wheel: moezero/checkpoint/hf/__init__.py "
                "(from torch_impl/checkpoint/hf/__init__.py)") in out


@pytest.mark.parametrize("stray", ["moezero/reference/plan/store.py", "tests/test_cli.py",
                                   "benchmarks/run.py", "torch_impl/cli.py"])
def test_a_stray_file_is_named(tmp_path, complete, capsys, stray):
    assert main([write_wheel(tmp_path / "m.whl", [*complete, stray])]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [f"m.whl: in the wheel but not in the source tree: {stray}"]


def test_an_sdist_without_its_license_is_named(tmp_path, capsys):
    good = ["pyproject.toml", "setup.py", "README.md", "LICENSE", "torch_impl/cli.py"]
    assert main([write_sdist(tmp_path / "m.tar.gz", good)]) == 0
    capsys.readouterr()
    assert main([write_sdist(tmp_path / "m.tar.gz", good[:3])]) == 1
    assert capsys.readouterr().out.splitlines() == ["m.tar.gz: missing from the sdist: LICENSE"]
