"""Tests of the checkpoint store (``moezero.plan.store``, ``.reading``, ``.stepdirs``): save from
simulated ranks, reshard on read, verify, commit.

A "rank" here is a loop iteration: each DP rank of each group writes its own shard with
``write_partition``, exactly as the torch writer does from its process.
"""

from __future__ import annotations

import json
import os
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from moezero.plan import (
    STATES,
    ParamSpec,
    plan_groups,
    plan_layout,
    plan_partitions,
    shapes_of,
    stepdirs,
    store,
)
from moezero.plan.layout import INDEX_NAME, MANIFEST_NAME
from moezero.plan.store import (
    CheckpointError,
    apply_retention,
    begin_save,
    commit,
    find_latest,
    read_manifest,
    read_param,
    read_range,
    read_shard,
    read_tensors,
    verify,
    write_headers,
    write_manifest,
    write_partition,
    write_range,
)

from .models import caps, models

SPLIT, CAP = True, None


def moe_model(ep: int, num_experts: int = 4):
    """Two dense params and two MoE layers whose experts hold two params each."""
    specs = [ParamSpec("embed.weight", (5, 3)), ParamSpec("norm.weight", (7,), user_group="nd")]
    for layer in ("layers.0.moe", "layers.1.moe"):
        specs += [ParamSpec(f"{layer}.experts.{e}.{n}", shape, moe_group=f"ep_size_{ep}",
                            ep_size=ep, layer=layer, expert=e)
                  for e in range(num_experts) for n, shape in (("w1", (3, 2)), ("w2", (5,)))]
    return specs


def random_state(specs, seed=0):
    """``{(fqn, state): flat float32 values}`` for every param and state."""
    rng = np.random.default_rng(seed)
    return {(s.fqn, state): rng.standard_normal(s.numel).astype(np.float32)
            for s in specs for state in STATES}


def shard_of(values, part, dp_rank, state):
    """What DP rank ``dp_rank`` holds of ``state`` under ``part``: its slice of the padded buffer."""
    out = np.full(part.shard_numel, np.nan, np.float32)  # padding never reaches disk
    for piece, offset in part.rank_slices(dp_rank):
        out[offset:offset + piece.numel] = values[(piece.fqn, state)][piece.start:piece.stop]
    return out


def save(root, specs, values, *, world_size, step, cap=CAP, split=SPLIT, align=1, **extra):
    """Save as W ranks would: rank 0 headers, every rank its shards, rank 0 manifest + commit."""
    groups = plan_groups(specs, max_group_size=cap, split_by_expert=split)
    layout = plan_layout(groups, shapes_of(specs), step=step)
    partial = begin_save(root, step)
    records = write_headers(layout, partial)
    for part in plan_partitions(groups, world_size=world_size, align=align):
        for d in range(part.dp_size):
            shards = {s: shard_of(values, part, d, s) for s in STATES}
            records += write_partition(partial, layout, part, d, fsync=False, **shards)
    write_manifest(partial, layout, checksums=records, **extra)
    return commit(partial)


def check_shards(ckpt, specs, values, *, world_size, cap, split, align=1):
    """Every rank's shard under the given plan equals the original values (padding zero)."""
    manifest = read_manifest(ckpt)
    groups = plan_groups(specs, max_group_size=cap, split_by_expert=split)
    for part in plan_partitions(groups, world_size=world_size, align=align):
        for d in range(part.dp_size):
            for state in STATES:
                expected = np.nan_to_num(shard_of(values, part, d, state), nan=0.0)
                got = read_shard(ckpt, manifest, part, d, state)
                np.testing.assert_array_equal(got, expected)


@pytest.fixture(autouse=True, scope="module")
def fsyncs():
    """Count fsyncs instead of waiting for the disk (a shared VM's fsync takes ~10 ms)."""
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", lambda fd: calls.append(os.readlink(f"/proc/self/fd/{fd}")))
        yield calls


@pytest.fixture
def saved(tmp_path):
    """A W=4, ep=2, cap 7 checkpoint of ``moe_model`` at step 5, with its values."""
    specs = moe_model(ep=2)
    values = random_state(specs)
    ckpt = save(tmp_path, specs, values, world_size=4, step=5, cap=7, split=False,
                config={"lr": 0.1}, topology={"world_size": 4}, state={"rng": [1, 2]})
    return ckpt, specs, values


# ---------------------------------------------------------------- save and reshard


def test_saved_checkpoint_reads_back_every_param_and_state(saved):
    ckpt, specs, values = saved
    manifest = read_manifest(ckpt)
    assert (manifest.step, manifest.config, manifest.topology, manifest.state) == (
        5, {"lr": 0.1}, {"world_size": 4}, {"rng": [1, 2]})
    for state in STATES:
        tensors = read_tensors(ckpt, manifest, state)
        for s in specs:
            np.testing.assert_array_equal(tensors[s.fqn], values[(s.fqn, state)].reshape(s.shape))
    assert verify(ckpt) == []


def test_saved_files_load_with_safetensors_by_key(saved):
    ckpt, _, values = saved
    for f in read_manifest(ckpt).layout.files:
        loaded = load_file(str(ckpt / f.name))
        assert set(loaded) == {t.key for t in f.tensors}
        for t in f.tensors:
            assert loaded[t.key].shape == t.shape
            np.testing.assert_array_equal(loaded[t.key].reshape(-1),
                                          values[(t.fqn, t.state)][t.start:t.stop])


def test_size_on_disk_is_twelve_bytes_per_element_plus_headers(saved):
    ckpt, specs, _ = saved
    layout = read_manifest(ckpt).layout
    data = sum(os.path.getsize(ckpt / f.name) for f in layout.files)
    headers = sum(f.data_start for f in layout.files)
    assert data == 12 * sum(s.numel for s in specs) + headers
    assert max(f.data_start for f in layout.files) <= 64 << 10
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(
        [f.name for f in layout.files] + [MANIFEST_NAME, INDEX_NAME])


@pytest.mark.parametrize("world_size, ep, cap, split, align", [
    (4, 2, 7, False, 1),    # same plan: contiguous fast path
    (2, 2, 7, False, 4),    # fewer ranks, same groups: still the fast path
    (8, 4, 7, False, 1),    # more ranks, other ep: groups hold other experts
    (1, 1, None, True, 1),  # single process, one group per expert
    (4, 4, 3, True, 2),     # other cap and split flag
    (2, 1, 5, False, 1),
])
def test_read_under_another_plan_reassembles_exactly(saved, world_size, ep, cap, split, align):
    ckpt, _, values = saved
    check_shards(ckpt, moe_model(ep=ep), values, world_size=world_size, cap=cap, split=split,
                 align=align)


def test_read_range_is_the_fast_path_and_refuses_changed_groups(saved):
    ckpt, specs, values = saved
    manifest = read_manifest(ckpt)
    groups = plan_groups(specs, max_group_size=7, split_by_expert=False)
    part = plan_partitions(groups, world_size=4)[0]
    out = np.full(part.shard_numel, 9.0, np.float32)
    assert read_range(ckpt, manifest, part, 1, "exp_avg", out=out) is out
    np.testing.assert_array_equal(out, np.nan_to_num(shard_of(values, part, 1, "exp_avg")))
    other = plan_partitions(plan_groups(specs, max_group_size=6), world_size=4)[0]
    with pytest.raises(ValueError, match="members differ"):
        read_range(ckpt, manifest, other, 0)


def test_read_param_gathers_ranges_across_fragments(saved):
    ckpt, _, values = saved
    manifest = read_manifest(ckpt)
    fqn = "embed.weight"  # 15 elements cut by the cap of 7 into three fragments
    assert len(manifest.layout.pieces(fqn)) == 3
    for start, stop in [(0, 15), (3, 12), (6, 8), (14, 15), (4, 4)]:
        np.testing.assert_array_equal(read_param(ckpt, manifest, fqn, start, stop, "exp_avg_sq"),
                                      values[(fqn, "exp_avg_sq")][start:stop])
    with pytest.raises(ValueError, match="outside"):
        read_param(ckpt, manifest, fqn, 0, 16)
    with pytest.raises(KeyError, match="not in the checkpoint"):
        read_param(ckpt, manifest, "nope")


@settings(max_examples=15, deadline=None)
@given(models(), caps, st.booleans(), caps, st.booleans(), st.integers(1, 3))
def test_random_models_reshard_exactly(model, cap, split, new_cap, new_split, factor):
    specs, world_size = model
    values = random_state(specs, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save(Path(tmp), specs, values, world_size=world_size, step=1, cap=cap, split=split)
        new_world = max([s.ep_size for s in specs], default=1) * factor
        check_shards(ckpt, specs, values, world_size=new_world, cap=new_cap, split=new_split)
        assert verify(ckpt) == []


# ---------------------------------------------------------------- write primitives


def test_write_range_chunks_and_checksums(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "CHUNK", 12)
    path = tmp_path / "f"
    path.write_bytes(bytes(100))
    data = np.arange(20, dtype=np.float32)
    assert write_range(path, 10, data) == zlib.crc32(data.tobytes())
    assert path.read_bytes()[10:90] == data.tobytes() and os.path.getsize(path) == 100
    with pytest.raises(ValueError, match="outside the 100-byte file"):
        write_range(path, 30, data)
    with pytest.raises(FileNotFoundError):
        write_range(tmp_path / "absent", 0, data)


def test_copy_range_moves_a_swap_partition_into_its_range(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "CHUNK", 16)
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    data = np.arange(25, dtype=np.float32)
    swap.write_bytes(data.tobytes())
    ckpt.write_bytes(bytes(120))
    assert store.copy_range(swap, 8, ckpt, 12, 80) == zlib.crc32(data.tobytes()[8:88])
    assert ckpt.read_bytes()[12:92] == data.tobytes()[8:88]
    with pytest.raises(ValueError, match="outside it"):
        store.copy_range(swap, 0, ckpt, 100, 40)
    with pytest.raises(CheckpointError, match="truncated"):
        store.copy_range(swap, 80, ckpt, 0, 40)


def test_write_partition_rejects_wrong_dtype_and_short_shards(tmp_path):
    specs = moe_model(ep=1)
    layout = plan_layout(plan_groups(specs), shapes_of(specs), step=0)
    part = plan_partitions(plan_groups(specs), world_size=1)[0]
    write_headers(layout, tmp_path)
    good = np.zeros(part.shard_numel, np.float32)
    with pytest.raises(ValueError, match="must be float32"):
        write_partition(tmp_path, layout, part, 0, master=good.astype(np.float64),
                        exp_avg=good, exp_avg_sq=good)
    with pytest.raises(ValueError, match="need at least"):
        write_partition(tmp_path, layout, part, 0, master=good[:3], exp_avg=good, exp_avg_sq=good)


def test_manifest_refuses_a_missing_rank(tmp_path):
    specs = moe_model(ep=1)
    groups = plan_groups(specs)
    layout = plan_layout(groups, shapes_of(specs), step=0)
    records = write_headers(layout, tmp_path)
    part = plan_partitions(groups, world_size=2)[0]
    shard = np.zeros(part.shard_numel, np.float32)
    records += write_partition(tmp_path, layout, part, 0, master=shard, exp_avg=shard,
                               exp_avg_sq=shard)
    with pytest.raises(ValueError, match=r"model-00001-of-00010.safetensors: bytes \[\d+, \d+\) are not covered"):
        write_manifest(tmp_path, layout, checksums=records)


# ---------------------------------------------------------------- verify and strict reading


def test_verify_catches_single_byte_flips_in_data_and_headers(saved):
    ckpt, _, _ = saved
    layout = read_manifest(ckpt).layout
    rng = np.random.default_rng(3)
    for f in layout.files:
        path = ckpt / f.name
        clean = path.read_bytes()
        positions = [*rng.integers(f.data_start, f.size, size=2), rng.integers(0, f.data_start)]
        for pos in positions:
            broken = bytearray(clean)
            broken[pos] ^= 1 << int(rng.integers(0, 8))
            path.write_bytes(bytes(broken))
            problems = verify(ckpt)
            assert len(problems) == 1 and f.name in problems[0], problems
            begin, end = map(int, problems[0].split("bytes [")[1].split(")")[0].split(", "))
            assert begin <= pos < end
        path.write_bytes(clean)
    assert verify(ckpt) == []


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.unlink(), "is missing"),
    (lambda p: os.truncate(p, os.path.getsize(p) - 1), "is truncated"),
])
def test_missing_or_truncated_file_is_one_line_naming_it(saved, damage, message):
    ckpt, _, _ = saved
    name = read_manifest(ckpt).layout.optim_files[1].name
    damage(ckpt / name)
    problems = verify(ckpt)
    assert len(problems) == 1 and name in problems[0] and message in problems[0]
    with pytest.raises(CheckpointError, match=message) as info:
        read_manifest(ckpt)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "sub/../../x", "", 5])
def test_manifest_naming_a_file_outside_is_rejected(saved, name):
    ckpt, _, _ = saved
    obj = json.loads((ckpt / MANIFEST_NAME).read_text())
    obj["files"][0]["name"] = name
    (ckpt / MANIFEST_NAME).write_text(json.dumps(obj))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory") as info:
        read_manifest(ckpt)
    assert "\n" not in str(info.value)


def test_symlink_escaping_the_directory_is_rejected(saved, tmp_path):
    ckpt, _, _ = saved
    name = read_manifest(ckpt).layout.model_files[0].name
    outside = tmp_path / "elsewhere"
    outside.write_bytes((ckpt / name).read_bytes())
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        read_manifest(ckpt)


@pytest.mark.parametrize("tamper, message", [
    (lambda m: m["files"][0].update(size=m["files"][0]["size"] + 4), "do not match the layout"),
    (lambda m: m.update(shapes=[1, 2]), "malformed manifest"),
    (lambda m: m.pop("groups"), "malformed manifest"),
    (lambda m: m["checksums"].pop(), "not covered"),
    (lambda m: m["checksums"][0].pop(), "malformed manifest"),
    (lambda m: m.update(format_version=2), "unsupported format_version 2"),
    (lambda m: m.update(format="other"), "not a moezero checkpoint manifest"),
])
def test_tampered_manifest_is_a_one_line_error(saved, tamper, message):
    ckpt, _, _ = saved
    obj = json.loads((ckpt / MANIFEST_NAME).read_text())
    tamper(obj)
    (ckpt / MANIFEST_NAME).write_text(json.dumps(obj))
    with pytest.raises(CheckpointError, match=message) as info:
        read_manifest(ckpt)
    assert "\n" not in str(info.value) and find_latest(ckpt.parent) is None


def test_unparsable_manifest_is_rejected(saved):
    ckpt, _, _ = saved
    (ckpt / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        read_manifest(ckpt)
    problems = verify(ckpt)
    assert len(problems) == 1 and "unreadable" in problems[0]


# ---------------------------------------------------------------- commit, latest, retention


def small_save(root, step):
    specs = moe_model(ep=1, num_experts=1)
    return save(root, specs, random_state(specs), world_size=2, step=step)


def test_commit_renames_and_points_latest(tmp_path, fsyncs):
    fsyncs.clear()
    ckpt = small_save(tmp_path, 50)
    partial = str(tmp_path / "step_00000050.partial")
    synced = set(fsyncs)
    assert {f"{partial}/{p.name}" for p in ckpt.iterdir()} <= synced  # every file
    assert {partial, str(tmp_path), f"{tmp_path}/latest.tmp"} <= synced  # dirs and latest
    assert fsyncs.index(partial) < fsyncs.index(str(tmp_path)) < fsyncs.index(f"{tmp_path}/latest.tmp")
    assert ckpt == tmp_path / "step_00000050" and ckpt.is_dir()
    assert not (tmp_path / "step_00000050.partial").exists()
    assert (tmp_path / "latest").read_text() == "step_00000050"
    assert not (tmp_path / "latest.tmp").exists()
    assert find_latest(tmp_path) == ckpt


def test_commit_refuses_an_incomplete_partial(tmp_path):
    partial = begin_save(tmp_path, 3)
    with pytest.raises(CheckpointError, match="incomplete"):
        commit(partial)
    assert find_latest(tmp_path) is None


def test_commit_given_the_layout_still_refuses_missing_and_truncated_files(tmp_path):
    specs = [ParamSpec("w", (8, 6)), ParamSpec("b", (5,))]
    layout = plan_layout(plan_groups(specs), shapes_of(specs), step=4)
    for damage in ("manifest", "truncate", None):
        partial = begin_save(tmp_path, 4)
        records = write_headers(layout, partial)
        for part in plan_partitions(plan_groups(specs), world_size=1):
            shards = {s: np.ones(part.shard_numel, np.float32) for s in STATES}
            records += write_partition(partial, layout, part, 0, fsync=False, **shards)
        write_manifest(partial, layout, checksums=records)
        if damage == "manifest":
            (partial / MANIFEST_NAME).unlink()
        elif damage == "truncate":
            os.truncate(partial / layout.files[0].name, 3)
        if damage is None:
            assert commit(partial, layout=layout) == tmp_path / "step_00000004"
            assert verify(tmp_path / "step_00000004") == []
            continue
        with pytest.raises(CheckpointError, match="incomplete" if damage == "manifest" else
                           layout.files[0].name):
            commit(partial, layout=layout)
        assert find_latest(tmp_path) is None


def test_find_latest_skips_partial_and_manifestless_dirs(tmp_path):
    small_save(tmp_path, 10)
    newer = small_save(tmp_path, 20)
    shutil_copy = newer.with_name("step_00000030.partial")
    newer.rename(shutil_copy)  # a complete-looking but uncommitted save
    (tmp_path / "step_00000040").mkdir()  # no manifest
    (tmp_path / "latest").write_text("step_00000040")
    assert find_latest(tmp_path) == tmp_path / "step_00000010"


def test_find_latest_honours_latest_and_falls_back_from_a_broken_one(tmp_path):
    old, new = small_save(tmp_path, 1), small_save(tmp_path, 2)
    (tmp_path / "latest").write_text(old.name)  # a user rolling back
    assert find_latest(tmp_path) == old
    (old / MANIFEST_NAME).unlink()
    assert find_latest(tmp_path) == new
    (tmp_path / "latest").write_text("../../etc")
    assert find_latest(tmp_path) == new


def test_recommitting_a_step_replaces_it(tmp_path):
    small_save(tmp_path, 7)
    again = small_save(tmp_path, 7)
    assert verify(again) == [] and find_latest(tmp_path) == again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000007"]


def test_retention_keeps_the_newest_and_latest(tmp_path):
    for step in (1, 2, 3, 4):
        small_save(tmp_path, step)
    begin_save(tmp_path, 2)  # a stale partial from a crashed save
    begin_save(tmp_path, 9)  # an in-flight save: kept
    (tmp_path / "latest").write_text("step_00000001")
    removed = apply_retention(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step_00000002", "step_00000002.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step_00000001", "step_00000003", "step_00000004", "step_00000009.partial"]
    with pytest.raises(ValueError, match="keep_last"):
        apply_retention(tmp_path, keep_last=0)


def test_retention_deletes_only_the_steps_a_run_owns(tmp_path):
    """``owned``: another run's complete steps neither count nor go (issue 38 #5's rule)."""
    for step in (1, 2, 3, 4, 5):
        small_save(tmp_path, step)
    (tmp_path / "latest").write_text("step_00000005")
    owned = [tmp_path / f"step_0000000{s}" for s in (3, 4, 5)]
    removed = apply_retention(tmp_path, keep_last=1, owned=owned)
    assert sorted(p.name for p in removed) == ["step_00000003", "step_00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step_00000001", "step_00000002", "step_00000005"]
    assert apply_retention(tmp_path, keep_last=1, owned=[]) == []


def test_retention_trusts_the_directory_just_committed(tmp_path, monkeypatch):
    """``committed`` is not re-read (the saver has just checked it); the others are."""
    old, new = small_save(tmp_path, 1), small_save(tmp_path, 2)
    read = []
    real = stepdirs.read_manifest
    monkeypatch.setattr(stepdirs, "read_manifest", lambda d: (read.append(Path(d)), real(d))[1])
    assert apply_retention(tmp_path, keep_last=1, committed=new) == [old]
    assert new not in read and old in read
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002"]
