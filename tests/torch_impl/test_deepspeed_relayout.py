"""``checkpoint/deepspeed/relayout``: the rewrite of raw-copied blocks on a hand-built layout
(a tensor split over two files, listed out of element order), its refusals."""

from __future__ import annotations

import zlib
from types import SimpleNamespace as NS

import numpy as np
import pytest

from moezero.checkpoint.deepspeed import relayout
from moezero.checkpoint.hf.gpt_oss import FAMILY
from moezero.plan.layout import RangeRecord
from moezero.plan.store import CheckpointError

# "x" [2, 3] master: elements 4..6 in b.bin (byte 8), 0..4 in a.bin (byte 16 + 4)
LAYOUT = NS(model_files=[
    NS(name="b.bin", data_start=8, tensors=[NS(fqn="x", state="master", begin=0, start=4, stop=6)]),
    NS(name="a.bin", data_start=16, tensors=[NS(fqn="x", state="master", begin=4, start=0,
                                                stop=4)])], optim_files=[])
BLOCK = relayout.Block(("x",), (2, 3), lambda t: (t.t(),))


def _files(tmp_path, b_size: int = 16) -> list[RangeRecord]:
    """The raw copy: x's elements 0..6 in its places, and one other range of a.bin (bytes 0..4)."""
    raw = np.arange(6, dtype=np.float32)
    a, b = np.zeros(9, np.float32), np.zeros(b_size // 4, np.float32)
    a[5:9], a[0] = raw[:4], 7.0
    b[2:] = raw[4:4 + len(b) - 2]
    (tmp_path / "a.bin").write_bytes(a.tobytes())
    (tmp_path / "b.bin").write_bytes(b.tobytes())
    return [RangeRecord("a.bin", 0, 4, zlib.crc32(a[:1].tobytes())),
            RangeRecord("a.bin", 20, 16, zlib.crc32(a[5:].tobytes())),
            RangeRecord("b.bin", 8, 8, zlib.crc32(b[2:].tobytes()))]


def test_a_block_over_two_files_is_rewritten_at_each_parts_offsets(tmp_path):
    records = relayout.apply(LAYOUT, tmp_path, [BLOCK], _files(tmp_path))
    want = np.arange(6, dtype=np.float32).reshape(2, 3).T.reshape(-1)  # 0 3 1 4 2 5
    a = np.frombuffer((tmp_path / "a.bin").read_bytes(), np.float32)
    b = np.frombuffer((tmp_path / "b.bin").read_bytes(), np.float32)
    assert a[0] == 7.0 and a[5:].tolist() == want[:4].tolist() and a[1:5].tolist() == [0] * 4
    assert b[2:].tolist() == want[4:].tolist()
    assert sorted(records) == sorted([
        RangeRecord("a.bin", 0, 4, zlib.crc32(a[:1].tobytes())),
        RangeRecord("a.bin", 20, 16, zlib.crc32(want[:4].tobytes())),
        RangeRecord("b.bin", 8, 8, zlib.crc32(want[4:].tobytes()))])


def test_a_short_read_names_the_file(tmp_path):
    records = _files(tmp_path, b_size=12)  # b.bin ends one element early
    with pytest.raises(CheckpointError, match=r"b\.bin: 4 bytes at 8, expected 8"):
        relayout.apply(LAYOUT, tmp_path, [BLOCK], records)


def test_gate_and_up_of_one_expert_copied_raw_only_in_pairs():
    arch = NS(dim=4, ffn_dim=2)
    pair = {"layers.0.moe.experts.1.w1.weight", "layers.0.moe.experts.1.w3.weight"}
    assert [b.fqns for b in relayout.relaid(pair, arch, FAMILY)] == [tuple(sorted(pair))]
    with pytest.raises(CheckpointError, match=r"experts\.1\.w3\.weight comes from the fused "
                                              r"gate_up_proj, layers\.0\.moe\.experts\.1\.w1"):
        relayout.relaid({"layers.0.moe.experts.1.w3.weight"}, arch, FAMILY)
