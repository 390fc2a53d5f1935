"""A weights-only layout in ``BF16`` or ``F16`` (``plan_layout(..., dtype=...)``: an import that
keeps its source's dtype): its files as the ``safetensors`` library reads them, the manifest
round trip, and the reads, which upcast exactly to float32. Files are assembled here from the
layout alone, the values bf16/fp16 numbers computed independently (bf16 as the top half of a
float32)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file

from moezero.plan import ParamSpec, plan_groups, plan_layout, shapes_of, store
from moezero.plan.manifest import manifest_from_json, manifest_to_json

SPECS = [ParamSpec("a", (10,)), ParamSpec("b", (2, 3))]
GROUPS = plan_groups(SPECS, max_group_size=4)


def _values(fqn: str, numel: int, dtype: str) -> np.ndarray:
    """float32 values exactly representable in ``dtype`` (bf16: low half of the bits zero)."""
    x = np.random.default_rng(len(fqn)).standard_normal(numel).astype(np.float32)
    if dtype == "BF16":
        return (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    return x.astype(np.float16).astype(np.float32)


def _encode(values: np.ndarray, dtype: str) -> bytes:
    if dtype == "BF16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return values.astype(np.float16).tobytes()


def _header(raw: bytes) -> dict:
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + length])


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_a_half_precision_layout_is_written_read_and_upcast_exactly(tmp_path, dtype):
    layout = plan_layout(GROUPS, shapes_of(SPECS), step=0, weights_only=True, dtype=dtype)
    assert layout.dtype == dtype and all(f.itemsize == 2 for f in layout.model_files)
    values = {s.fqn: _values(s.fqn, int(np.prod(s.shape)), dtype) for s in SPECS}
    records = []
    for f in layout.model_files:
        data = b"".join(_encode(values[t.fqn][t.start:t.stop], dtype) for t in f.tensors)
        assert len(data) == f.data_size == 2 * sum(t.stop - t.start for t in f.tensors)
        (tmp_path / f.name).write_bytes(f.header + data)
        header = _header(f.header)
        assert {header[t.key]["dtype"] for t in f.tensors} == {dtype}
        if dtype == "F16":  # numpy has no bfloat16: the library reads the F16 files only
            loaded = load_file(tmp_path / f.name)
            assert all(np.array_equal(loaded[t.key].reshape(-1).astype(np.float32),
                                      values[t.fqn][t.start:t.stop]) for t in f.tensors)
        records.append((f.name, 0, f.size, 0))
    manifest = manifest_from_json(json.loads(json.dumps(manifest_to_json(
        store.Manifest(layout, tuple(store.RangeRecord(*r) for r in records))))))
    assert manifest.layout == layout
    for s in SPECS:
        got = store.read_param(tmp_path, manifest, s.fqn)
        assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32),
                                                          values[s.fqn].view(np.uint32))


def test_only_a_weights_only_layout_may_be_half_precision():
    with pytest.raises(ValueError, match="must be weights only"):
        plan_layout(GROUPS, shapes_of(SPECS), step=0, dtype="BF16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        plan_layout(GROUPS, shapes_of(SPECS), step=0, weights_only=True, dtype="F8")
    assert plan_layout(GROUPS, shapes_of(SPECS), step=0).dtype == "F32"
