"""Verified reads (``moezero.plan.checked.CheckedReader``): reads under any plan return what a
plain read returns while checking every checksummed range they touch, in chunks smaller than
the ranges; a damaged byte or header is named with its file and range."""

from __future__ import annotations

import re

import numpy as np
import pytest

from moezero.plan import STATES, plan_groups, plan_partitions
from moezero.plan.checked import CheckedReader, PlainReader
from moezero.plan.store import CheckpointError, read_manifest, read_shard

from .test_store import fsyncs, moe_model, random_state, save, shard_of  # noqa: F401 (fixture)

PLANS = [  # (world_size, ep, cap, split): the saving plan, then others
    (4, 2, 7, False), (2, 2, 7, False), (8, 4, 7, False), (1, 1, None, True), (4, 4, 3, True),
]


@pytest.fixture
def saved(tmp_path):
    specs = moe_model(ep=2)
    values = random_state(specs)
    return save(tmp_path, specs, values, world_size=4, step=5, cap=7, split=False), values


def read_all(ckpt, reader, world_size, ep, cap, split) -> list[np.ndarray]:
    """Every DP rank's shard of every group and state under a plan."""
    manifest = read_manifest(ckpt)
    groups = plan_groups(moe_model(ep=ep), max_group_size=cap, split_by_expert=split)
    return [read_shard(ckpt, manifest, part, d, s, reader=reader)
            for part in plan_partitions(groups, world_size=world_size)
            for d in range(part.dp_size) for s in STATES]


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("chunk", [4, 12, 1 << 20])
def test_checked_reads_equal_plain_reads_and_check_every_range(saved, plan, chunk):
    ckpt, _ = saved
    manifest = read_manifest(ckpt)
    checked = CheckedReader(ckpt, manifest, chunk=chunk)
    got = read_all(ckpt, checked, *plan)
    want = read_all(ckpt, PlainReader(ckpt, manifest), *plan)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    data = {r for r in manifest.checksums if r.offset and r.length}
    assert data and checked._verified == data  # every data range was checked


def _flip(path, pos):
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x01
    path.write_bytes(data)


@pytest.mark.parametrize("plan", PLANS)
def test_a_flipped_byte_fails_the_read_naming_its_range(saved, plan):
    """Whichever plan reads (whole ranges or pieces of them), the damaged range is named."""
    ckpt, _ = saved
    manifest = read_manifest(ckpt)
    rng = np.random.default_rng(sum(map(hash, map(str, plan))) % 1000)
    records = [r for r in manifest.checksums if r.offset and r.length > 8]
    for r in (records[i] for i in rng.choice(len(records), 3, replace=False)):
        pos = r.offset + int(rng.integers(r.length))
        _flip(ckpt / r.file, pos)
        with pytest.raises(CheckpointError) as err:
            read_all(ckpt, CheckedReader(ckpt, manifest, chunk=8), *plan)
        named = re.search(rf"{re.escape(r.file)} bytes \[(\d+), (\d+)\): crc32", str(err.value))
        assert named and (int(named[1]), int(named[2])) == (r.offset, r.offset + r.length)
        _flip(ckpt / r.file, pos)
    read_all(ckpt, CheckedReader(ckpt, manifest, chunk=8), *plan)  # sound again


def test_a_changed_header_is_named_before_any_data_is_read(saved):
    ckpt, _ = saved
    manifest = read_manifest(ckpt)
    f = manifest.layout.model_files[0]
    _flip(ckpt / f.name, f.data_start - 20)  # inside the JSON (or its padding)
    with pytest.raises(CheckpointError, match=rf"{f.name} bytes \[0, {f.data_start}\): the "
                                              "safetensors header differs"):
        read_all(ckpt, CheckedReader(ckpt, manifest), 4, 2, 7, False)


def test_copy_to_checks_file_to_file_copies(saved, tmp_path):
    """An exact range is copied file to file and checked by the copy's own crc32; any other
    span goes through a checked read."""
    ckpt, _ = saved
    manifest = read_manifest(ckpt)
    r = max((r for r in manifest.checksums if r.offset), key=lambda r: r.length)
    src = (ckpt / r.file).read_bytes()
    for offset, length in ((r.offset, r.length), (r.offset + 4, r.length - 8)):
        dst = tmp_path / "swap"
        dst.write_bytes(bytes(length + 16))
        CheckedReader(ckpt, manifest, chunk=8).copy_to(r.file, offset, length, dst, 16)
        assert dst.read_bytes()[16:] == src[offset:offset + length]
    _flip(ckpt / r.file, r.offset + r.length // 2)
    for offset, length in ((r.offset, r.length), (r.offset + 4, r.length - 8)):
        (tmp_path / "swap").write_bytes(bytes(length + 16))
        with pytest.raises(CheckpointError, match=rf"bytes \[{r.offset}, {r.offset + r.length}\)"):
            CheckedReader(ckpt, manifest, chunk=8).copy_to(r.file, offset, length,
                                                           tmp_path / "swap", 16)


@pytest.mark.parametrize("plan", PLANS)
def test_a_span_of_a_shard_is_those_elements_of_it(saved, plan):
    """``read_shard(span=(lo, hi))`` (a load streaming a shard through a small buffer) gives
    elements [lo, hi) of the shard, padding zero, checked or not, for every group and state."""
    ckpt, values = saved
    world_size, ep, cap, split = plan
    manifest = read_manifest(ckpt)
    groups = plan_groups(moe_model(ep=ep), max_group_size=cap, split_by_expert=split)
    for part in plan_partitions(groups, world_size=world_size):
        for d in range(part.dp_size):
            for s in STATES:
                want = np.nan_to_num(shard_of(values, part, d, s))
                n = part.shard_numel
                for lo, hi in {(0, n), (0, 1), (1, n), (n // 2, n), (n // 3, 2 * n // 3 + 1)}:
                    lo, hi = min(lo, n), min(hi, n)
                    for reader in (PlainReader(ckpt, manifest),
                                   CheckedReader(ckpt, manifest, chunk=8)):
                        got = read_shard(ckpt, manifest, part, d, s, reader=reader,
                                         span=(lo, hi))
                        np.testing.assert_array_equal(got, want[lo:hi])
    with pytest.raises(ValueError, match="outside"):
        read_shard(ckpt, manifest, part, 0, span=(0, part.shard_numel + 1))


def test_copy_to_across_several_ranges_checks_each(saved, tmp_path):
    """Bytes spanning several checksummed ranges (a rank's range saved by two ranks) are
    copied exactly, each whole range file to file, the partial ones through small reads; a
    damaged range among them is named."""
    ckpt, _ = saved
    manifest = read_manifest(ckpt)
    by_file = {}
    for r in sorted(manifest.checksums):
        if r.offset and r.length:
            by_file.setdefault(r.file, []).append(r)
    name, records = max(by_file.items(), key=lambda kv: len(kv[1]))
    assert len(records) >= 3
    src = (ckpt / name).read_bytes()
    offset = records[0].offset + 2
    length = records[-1].offset + records[-1].length - 2 - offset
    dst = tmp_path / "swap"
    dst.write_bytes(bytes(length + 8))
    reader = CheckedReader(ckpt, manifest, chunk=8)
    reader.copy_to(name, offset, length, dst, 8)
    assert dst.read_bytes()[8:] == src[offset:offset + length]
    assert set(records) <= reader._verified  # every range was checked
    bad = records[1]
    _flip(ckpt / name, bad.offset + bad.length // 2)
    with pytest.raises(CheckpointError, match=rf"bytes \[{bad.offset}, {bad.offset + bad.length}\)"):
        CheckedReader(ckpt, manifest, chunk=8).copy_to(name, offset, length, dst, 8)
