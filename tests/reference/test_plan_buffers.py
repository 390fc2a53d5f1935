"""Buffers in the plan (``moezero.plan.model_buffers``): the expert bias is in no optimizer
group, and the layout stores it whole in ``buffers.safetensors``, written, checksummed and read
back like every other file; a manifest without buffers is unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from moezero.plan import ParamSpec, plan_groups, plan_layout, store
from moezero.plan.manifest import manifest_from_json, manifest_to_json
from moezero.plan.model_buffer_io import check_buffers, write_buffers
from moezero.plan.model_buffers import BUFFERS_FILE, is_buffer, split_buffers

SPECS = [ParamSpec("layers.0.moe.router.weight", (4, 3)), ParamSpec("norm.weight", (3,))]
BUFFERS = {"layers.10.moe.router.expert_bias": (4,), "layers.2.moe.router.expert_bias": (4,)}


def layout(**kw):
    groups = plan_groups(SPECS, max_group_size=5)
    return plan_layout(groups, {s.fqn: s.shape for s in SPECS}, step=3, **kw)


def test_the_rule():
    assert is_buffer("layers.0.moe.router.expert_bias")
    assert not is_buffer("layers.0.moe.router.weight") and not is_buffer("x.bias")
    assert split_buffers({"a.expert_bias": (2,), "a.weight": (1,)}) == (
        {"a.weight": (1,)}, {"a.expert_bias": (2,)})


def test_a_buffer_is_never_in_an_optimizer_group():
    with pytest.raises(ValueError, match=r"'layers.0.moe.router.expert_bias' is a buffer"):
        plan_groups([*SPECS, ParamSpec("layers.0.moe.router.expert_bias", (4,))])


def test_buffers_get_one_file_in_natural_order_and_survive_the_manifest():
    plain, with_buffers = layout(), layout(buffers=BUFFERS)
    assert with_buffers.files[:-1] == plain.files
    f = with_buffers.files[-1]
    assert (f.name, f.kind, with_buffers.buffer_file) == (BUFFERS_FILE, "buffers", f)
    assert [t.fqn for t in f.tensors] == ["layers.2.moe.router.expert_bias",
                                          "layers.10.moe.router.expert_bias"]
    assert "buffers" not in manifest_to_json(store.Manifest(plain, ()))  # unchanged
    back = manifest_from_json(manifest_to_json(store.Manifest(with_buffers, ())) | {
        "checksums": [[g.name, 0, g.size, 0] for g in with_buffers.files]})
    assert back.layout == with_buffers and back.layout.shape(f.tensors[0].fqn) == (4,)


def test_a_buffer_that_is_also_a_parameter_is_refused():
    with pytest.raises(ValueError, match="both a parameter and a buffer"):
        layout(buffers={"norm.weight": (3,)})


def test_written_checksummed_and_read_back(tmp_path):
    lay = layout(buffers=BUFFERS)
    values = {k: np.arange(4, dtype=np.float32) + i for i, k in enumerate(BUFFERS)}
    partial = store.begin_save(tmp_path, 3)
    records = store.write_headers(lay, partial) + write_buffers(partial, lay, values)
    for f in lay.model_files + lay.optim_files:  # the params' bytes, any values
        records.append(store.RangeRecord(f.name, f.data_start, f.data_size,
                                         store.write_range(partial / f.name, f.data_start,
                                                           bytes(f.data_size))))
    headers_only = [r for r in records if r.file != BUFFERS_FILE or r.offset == 0]
    with pytest.raises(ValueError, match=BUFFERS_FILE):  # the buffers must be covered too
        store.write_manifest(partial, lay, checksums=headers_only)
    store.write_manifest(partial, lay, checksums=records)
    step = store.commit(partial)
    manifest = store.read_manifest(step)
    assert store.verify(step) == []
    for k, v in values.items():
        np.testing.assert_array_equal(store.read_param(step, manifest, k), v)
    assert set(store.read_tensors(step, manifest)) == {s.fqn for s in SPECS} | set(BUFFERS)
    check_buffers(manifest, {**BUFFERS, "other.expert_bias": (2,)}, step)  # fewer: fine
    with pytest.raises(store.CheckpointError, match="has buffer layers.10"):
        check_buffers(manifest, {"layers.2.moe.router.expert_bias": (4,)}, step)
    with pytest.raises(store.CheckpointError, match=r"shape \(4,\) in the checkpoint, \(5,\)"):
        check_buffers(manifest, {k: (5,) for k in BUFFERS}, step)
