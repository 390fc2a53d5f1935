"""A damaged safetensors file given to ``moezero import-hf`` (docs/hf.md): one line naming the
file, exit 2, nothing written — for each way a file breaks, in a sharded folder (an index) and
in a single ``model.safetensors``."""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import pytest

from moezero.cli import main
from tests.torch_impl.test_hf import hf_model, save_hf

pytest.importorskip("transformers")


def truncated(data: bytes) -> bytes:
    return data[:len(data) - 100]


def garbage_header_length(data: bytes) -> bytes:
    return struct.pack("<Q", 1 << 62) + data[8:]


def broken_header_json(data: bytes) -> bytes:
    size = struct.unpack("<Q", data[:8])[0]
    header = bytearray(data[8:8 + size])
    header[header.index(b'"dtype"') + 7] = ord(";")  # '"dtype":' -> '"dtype";'
    return data[:8] + bytes(header) + data[8 + size:]


def empty(data: bytes) -> bytes:
    return b""


def random_bytes(data: bytes) -> bytes:
    return random.Random(0).randbytes(len(data))


DAMAGE = [truncated, garbage_header_length, broken_header_json, empty, random_bytes]


@pytest.fixture(scope="module", params=["sharded", "single"])
def hf_source(request, tmp_path_factory) -> tuple[Path, str]:
    """A folder of a tiny Mixtral and the safetensors file to damage."""
    root = tmp_path_factory.mktemp(request.param) / "hf"
    save_hf(hf_model(), root, fused=request.param == "single")
    if request.param == "single":
        return root, "model.safetensors"
    index = json.loads((root / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    return root, files[len(files) // 2]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_a_damaged_safetensors_file_is_one_line_naming_it(hf_source, damage, tmp_path, capsys):
    clean, name = hf_source
    src = Path(shutil.copytree(clean, tmp_path / "hf"))
    (src / name).write_bytes(damage((src / name).read_bytes()))
    capsys.readouterr()
    code = main(["import-hf", str(src), "--out", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"moezero: error: {src / name}: "), err[0]
    assert not (tmp_path / "ckpt").exists()
