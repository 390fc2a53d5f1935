"""Tests of ``moezero.plan.layout``: literal layouts, then properties over random models.

Files are assembled here from the layout alone (header bytes + data), independently of
``moezero.plan.store``, and loaded with the ``safetensors`` library.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from moezero.plan import (
    ParamSpec,
    fragment_key,
    index_json,
    parse_key,
    plan_groups,
    plan_layout,
    plan_partitions,
    rank_ranges,
    shapes_of,
)
from moezero.plan.manifest import Manifest, check_tiling, manifest_from_json, manifest_to_json

from .test_plan_grouping import caps, example_model, models

SETTINGS = settings(max_examples=40, deadline=None)


def small_model():
    """``a`` (10 elements) cut by a cap of 4, and a whole ``b`` (2x3)."""
    specs = [ParamSpec("a", (10,)), ParamSpec("b", (2, 3))]
    return specs, plan_groups(specs, max_group_size=4)


def parse_header(raw: bytes):
    """(data start, header dict) of a safetensors file's bytes."""
    (length,) = struct.unpack("<Q", raw[:8])
    return 8 + length, json.loads(raw[8:8 + length])


# ---------------------------------------------------------------- literal examples


def test_small_model_files_keys_and_offsets():
    specs, groups = small_model()
    layout = plan_layout(groups, shapes_of(specs), step=7)
    assert [f.name for f in layout.model_files] == [
        f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert [f.name for f in layout.optim_files] == [
        f"optim-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    third = layout.model_files[2]
    assert [(t.key, t.shape, t.begin, t.end) for t in third.tensors] == [
        ("a@8:10", (2,), 0, 8), ("b@0:2", (2,), 8, 16)]
    assert [(t.key, t.begin) for t in layout.optim_files[3].tensors] == [
        ("b.exp_avg@2:6", 0), ("b.exp_avg_sq@2:6", 16)]
    assert layout.shapes == (("a", (10,)), ("b", (2, 3)))


def test_whole_params_keep_their_name_and_shape():
    groups = plan_groups(example_model())
    layout = plan_layout(groups, shapes_of(example_model()), step=0)
    assert [(t.key, t.shape) for t in layout.model_files[0].tensors] == [("embed.weight", (2, 3))]
    assert [t.key for t in layout.optim_files[1].tensors] == [
        "layers.2.norm.weight.exp_avg", "layers.10.norm.weight.exp_avg",
        "layers.2.norm.weight.exp_avg_sq", "layers.10.norm.weight.exp_avg_sq"]


def test_header_is_safetensors_with_metadata_and_padding():
    specs, groups = small_model()
    f = plan_layout(groups, shapes_of(specs), step=7).model_files[2]
    start, header = parse_header(f.header)
    assert start == f.data_start == len(f.header) and start % 8 == 0
    assert f.header.endswith(b" " * (len(f.header) - len(f.header.rstrip(b" "))))
    assert header["__metadata__"] == {"format": "pt", "moezero.format_version": "1",
                                      "moezero.kind": "model", "moezero.group": "dense/default/2",
                                      "moezero.step": "7"}
    assert header["b@0:2"] == {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}


def test_rank_ranges_clip_padding_and_skip_it():
    specs, groups = small_model()
    layout = plan_layout(groups, shapes_of(specs), step=0)
    part = plan_partitions(groups, world_size=3)[0]  # 4 elements padded to 6: 2 per rank
    r0, r2 = rank_ranges(layout, part, 0), rank_ranges(layout, part, 2)
    model, optim = layout.model_files[0], layout.optim_files[0]
    assert r0.master == (model.name, model.data_start, 8) and r0.numel == 2
    assert r0.exp_avg == (optim.name, optim.data_start, 8)
    assert r0.exp_avg_sq == (optim.name, optim.data_start + 16, 8)
    assert r2.numel == 0 and r2.master.length == 0


def test_rank_ranges_refuse_a_changed_group():
    specs, groups = small_model()
    layout = plan_layout(groups, shapes_of(specs), step=0)
    other = plan_partitions(plan_groups(specs, max_group_size=5), world_size=1)[0]
    with pytest.raises(ValueError, match="members differ from the saved plan"):
        rank_ranges(layout, other, 0)


def test_fragment_keys_round_trip():
    assert fragment_key("x.exp_avg", 3, 9) == "x.exp_avg@3:9"
    assert parse_key("x.exp_avg@3:9") == ("x.exp_avg", 3, 9)
    assert parse_key("layers.0.w") == ("layers.0.w", None, None)


def test_index_has_weight_map_and_total_size():
    specs, groups = small_model()
    index = index_json(plan_layout(groups, shapes_of(specs), step=3))
    assert index["metadata"]["total_size"] == 16 * 4
    assert index["weight_map"] == {
        "a@0:4": "model-00001-of-00004.safetensors", "a@4:8": "model-00002-of-00004.safetensors",
        "a@8:10": "model-00003-of-00004.safetensors", "b@0:2": "model-00003-of-00004.safetensors",
        "b@2:6": "model-00004-of-00004.safetensors"}


@pytest.mark.parametrize("shapes, message", [
    ({"a": (10,)}, "'b' is in the groups but has no shape"),
    ({"a": (10,), "b": (2, 3), "c": (1,)}, "'c' has a shape but is in no group"),
    ({"a": (11,), "b": (2, 3)}, "do not tile its 11 elements"),
])
def test_bad_shapes_are_one_line_errors(shapes, message):
    _, groups = small_model()
    with pytest.raises(ValueError, match=message) as info:
        plan_layout(groups, shapes, step=0)
    assert "\n" not in str(info.value)


def test_at_sign_in_fqn_is_refused():
    specs = [ParamSpec("a@0:1", (1,))]
    with pytest.raises(ValueError, match="reserved for fragment keys"):
        plan_layout(plan_groups(specs), shapes_of(specs), step=0)


def test_manifest_json_round_trips_and_checks_tiling():
    specs, groups = small_model()
    layout = plan_layout(groups, shapes_of(specs), step=3)
    records = [(f.name, 0, f.size, 0) for f in layout.files]
    manifest = Manifest(layout, tuple(records), {"a": 1}, {"world_size": 2}, {"rng": [1]})
    assert manifest_from_json(json.loads(json.dumps(manifest_to_json(manifest)))) == manifest
    with pytest.raises(ValueError, match="bytes \\[0, 8\\) are not covered"):
        check_tiling(layout, [(f.name, 8, f.size - 8, 0) for f in layout.files])


# ---------------------------------------------------------------- properties


def random_plan(draw_model, cap, split):
    specs, world_size = draw_model
    groups = plan_groups(specs, max_group_size=cap, split_by_expert=split)
    return specs, groups, world_size


@SETTINGS
@given(models(), caps, st.booleans(), st.sampled_from((1, 2, 4)))
def test_rank_ranges_tile_every_file_exactly_once(model, cap, split, align):
    specs, groups, world_size = random_plan(model, cap, split)
    layout = plan_layout(groups, shapes_of(specs), step=1)
    covered = {f.name: [(0, f.data_start)] for f in layout.files}
    for part in plan_partitions(groups, world_size=world_size, align=align):
        for d in range(part.dp_size):
            ranges = rank_ranges(layout, part, d)
            for r in ranges[:3]:
                assert r.length == ranges.numel * 4
                covered[r.file].append((r.offset, r.offset + r.length))
    for f in layout.files:
        spans = sorted(s for s in covered[f.name] if s[0] < s[1])
        assert [b for _, b in spans[:-1]] == [a for a, _ in spans[1:]]
        assert spans[-1][1] == f.size


@SETTINGS
@given(models(), caps, st.booleans())
def test_each_rank_state_is_one_contiguous_run_of_its_pieces(model, cap, split):
    specs, groups, world_size = random_plan(model, cap, split)
    layout = plan_layout(groups, shapes_of(specs), step=1)
    for part in plan_partitions(groups, world_size=world_size):
        for d in range(part.dp_size):
            ranges = rank_ranges(layout, part, d)
            for state in ("master", "exp_avg", "exp_avg_sq"):
                cursor = getattr(ranges, state).offset
                for piece, _ in part.rank_slices(d):
                    f, t = next(p for p in layout.pieces(piece.fqn, state)
                                if p[1].start <= piece.start < p[1].stop)
                    assert f.name == getattr(ranges, state).file
                    assert f.data_start + t.begin + (piece.start - t.start) * 4 == cursor
                    cursor += piece.numel * 4
                assert cursor == getattr(ranges, state).offset + getattr(ranges, state).length


@SETTINGS
@given(models(), caps, st.booleans(), st.randoms())
def test_layout_is_deterministic_sized_and_parseable(model, cap, split, rng):
    specs, groups, _ = random_plan(model, cap, split)
    layout = plan_layout(groups, shapes_of(specs), step=9)
    shuffled = list(specs)
    rng.shuffle(shuffled)
    again = plan_layout(plan_groups(shuffled, max_group_size=cap, split_by_expert=split),
                        shapes_of(shuffled), step=9)
    assert again == layout
    assert [f.header for f in again.files] == [f.header for f in layout.files]
    numel = sum(s.numel for s in specs)
    assert sum(f.size for f in layout.files) == 12 * numel + sum(f.data_start for f in layout.files)
    for f in layout.files:
        start, header = parse_header(f.header)
        assert start % 8 == 0 and start <= 64 << 10
        offsets = [header[t.key]["data_offsets"] for t in f.tensors]
        assert offsets[0][0] == 0 and offsets[-1][1] == f.data_size
        assert all(a[1] == b[0] for a, b in zip(offsets, offsets[1:], strict=False))
        assert len(header) == len(f.tensors) + 1


@settings(max_examples=15, deadline=None)
@given(models(), caps, st.booleans())
def test_files_load_with_safetensors_and_reassemble(model, cap, split):
    specs, groups, _ = random_plan(model, cap, split)
    layout = plan_layout(groups, shapes_of(specs), step=2)
    rng = np.random.default_rng(0)
    full = {(s.fqn, st_): rng.standard_normal(s.numel).astype(np.float32)
            for s in specs for st_ in ("master", "exp_avg", "exp_avg_sq")}
    with tempfile.TemporaryDirectory() as tmp:
        loaded = {}
        for f in layout.files:
            data = b"".join(full[(t.fqn, t.state)][t.start:t.stop].tobytes() for t in f.tensors)
            (Path(tmp) / f.name).write_bytes(f.header + data)
            loaded[f.name] = load_file(str(Path(tmp) / f.name))
    for f in layout.files:
        assert set(loaded[f.name]) == {t.key for t in f.tensors}
        for t in f.tensors:
            np.testing.assert_array_equal(loaded[f.name][t.key].reshape(-1),
                                          full[(t.fqn, t.state)][t.start:t.stop])
            assert loaded[f.name][t.key].shape == t.shape
    for (fqn, state), value in full.items():  # reassemble fragments from their keys
        name = fqn if state == "master" else f"{fqn}.{state}"
        parts = sorted((parse_key(k)[1] or 0, arr.reshape(-1)) for file in loaded.values()
                       for k, arr in file.items() if parse_key(k)[0] == name)
        np.testing.assert_array_equal(np.concatenate([p for _, p in parts]), value)
