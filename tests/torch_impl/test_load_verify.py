"""Loading verifies (issue 15, item 1): every checksummed range's crc32 is computed while it is
read and each file's safetensors header is compared with the manifest's layout; a mismatch is
one ``CheckpointError`` line naming the file and byte range, and the engine's state is not
derived from what was read. ``IOOptions.chunk_bytes`` sets the read chunk, so small chunks put
every range of these tiny checkpoints across several reads (a checksum that dropped its
running value between chunks fails the clean loads here).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from moezero.checkpoint.core import CheckpointError
from moezero.config import Config
from moezero.offload.options import IOOptions
from moezero.plan import store
from moezero.train import setup
from tests.torch_impl.test_checkpoint import ccfg, train_run

CHUNK = 4096


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A W = 1, stage 2 checkpoint after one step, and its config."""
    root = tmp_path_factory.mktemp("verify")
    cfg = ccfg(world=1, stage=2)
    train_run(cfg, 1, saves=((1, str(root), False),))
    return cfg, root / "step_00000001"


def _engine(cfg_data: dict, io: IOOptions | None = None, **checkpoint):
    cfg = Config.model_validate(cfg_data)
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    return setup(cfg, torch.device("cpu"), io)[0]


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest / src.name)
    return dest / src.name


def _flip(path: Path, pos: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x10
    path.write_bytes(data)


def _long_record(step: Path, chunks: int = 3):
    """A checksummed data range spanning at least ``chunks`` read chunks of CHUNK bytes."""
    records = [r for r in store.read_manifest(step).checksums
               if r.offset and r.length >= chunks * CHUNK]
    assert records, "every range fits one chunk: the test would not cross a chunk boundary"
    return max(records, key=lambda r: r.length)


def _named_range(message: str) -> tuple[int, int]:
    found = re.search(r"bytes \[(\d+), (\d+)\)", message)
    assert found, message
    return int(found.group(1)), int(found.group(2))


def test_clean_multi_chunk_load_gives_the_saved_state(saved):
    """Small read chunks: each range is read (and checksummed) in several pieces; a checksum
    that restarted at each chunk would refuse this clean checkpoint."""
    cfg, step = saved
    _long_record(step)
    engine = _engine(cfg, IOOptions(chunk_bytes=CHUNK))
    state = engine.load_checkpoint(step)
    assert engine.global_steps == 1 and state["data"]["step"] == 1
    master = store.read_tensors(step, store.read_manifest(step))
    for fqn, p in engine.params.items():
        assert np.array_equal(p.detach().numpy(), master[fqn]), fqn


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_bit_in_any_chunk_of_a_range_is_refused(saved, tmp_path, where):
    cfg, step = saved
    bad = _copy(step, tmp_path)
    record = _long_record(bad)
    pos = {"first": record.offset + 5, "middle": record.offset + CHUNK + 17,
           "last": record.offset + record.length - 1}[where]
    _flip(bad / record.file, pos)
    engine = _engine(cfg, IOOptions(chunk_bytes=CHUNK))
    with pytest.raises(CheckpointError) as err:
        engine.load_checkpoint(bad)
    message = str(err.value)
    assert "\n" not in message and record.file in message and "crc32" in message, message
    begin, end = _named_range(message)
    assert (begin, end) == (record.offset, record.offset + record.length), message
    assert engine.global_steps == 0  # the counters (and params) were not taken from it


def test_an_overwritten_header_is_refused(saved, tmp_path):
    """A header that still parses but describes other tensors (a dtype changed)."""
    cfg, step = saved
    bad = _copy(step, tmp_path)
    victim = store.read_manifest(bad).layout.optim_files[1]
    data = bytearray((bad / victim.name).read_bytes())
    at = data.index(b'"F32"', 0, victim.data_start)
    data[at:at + 5] = b'"F16"'
    (bad / victim.name).write_bytes(data)
    with pytest.raises(CheckpointError) as err:
        _engine(cfg).load_checkpoint(bad)
    message = str(err.value)
    assert "\n" not in message and victim.name in message and "header" in message, message
    assert _named_range(message) == (0, victim.data_start)


def test_verify_on_load_false_reads_without_checking(saved, tmp_path):
    """``checkpoint.verify_on_load: false`` is the documented way out: the flipped value is
    loaded as it is."""
    cfg, step = saved
    bad = _copy(step, tmp_path)
    record = _long_record(bad)
    _flip(bad / record.file, record.offset + 2 * CHUNK + 3)
    _engine(cfg, IOOptions(chunk_bytes=CHUNK), verify_on_load=False).load_checkpoint(bad)


def test_checkpoint_verify_tool_reads_in_small_chunks(saved, tmp_path):
    """``store.verify`` with a small chunk: clean stays clean, a flip in a middle chunk is
    named with its range."""
    _, step = saved
    assert store.verify(step, chunk=CHUNK) == []
    bad = _copy(step, tmp_path)
    record = _long_record(bad)
    _flip(bad / record.file, record.offset + CHUNK + 1)
    (line,) = store.verify(bad, chunk=CHUNK)
    assert record.file in line
    assert _named_range(line) == (record.offset, record.offset + record.length)
