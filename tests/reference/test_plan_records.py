"""``moezero.plan.records``: the manifest's topology and engine records both savers write."""

from __future__ import annotations

import json

import numpy as np

from moezero.plan.bytes_io import byte_view
from moezero.plan.records import EngineRecord, TopologyRecord


def test_topology_record_json_is_the_manifest_format():
    torch_side = TopologyRecord(4, (2,), 2, "bfloat16", None, True, offload_optimizer="nvme")
    assert torch_side.to_json() == {
        "world_size": 4, "ep_sizes": [2], "zero_stage": 2, "dtype": "bfloat16",
        "offload_optimizer": "nvme", "max_group_size": None, "split_groups_by_expert": True}
    reference = TopologyRecord(1, (1,), None, "float32", 1000, False, writer="reference")
    assert reference.to_json() == {
        "world_size": 1, "ep_sizes": [1], "zero_stage": None, "dtype": "float32",
        "max_group_size": 1000, "split_groups_by_expert": False, "writer": "reference"}
    json.dumps(torch_side.to_json(), allow_nan=False)


def test_engine_record_round_trips_and_defaults_to_a_fresh_start():
    record = EngineRecord(7, 9, 0.25, {"scale": 128.0, "good_steps": 3, "hysteresis_left": 2})
    data = record.to_json()
    assert data["lr_step"] == 7 and data["step_count"] == 7 and data["global_steps"] == 9
    assert EngineRecord.from_json(json.loads(json.dumps(data))) == record
    assert EngineRecord.from_json(None) == EngineRecord(0, 0)
    assert EngineRecord.from_json({"step_count": 5}) == EngineRecord(5, 5)
    assert "loss_scaler" not in EngineRecord(1, 1, 0.1).to_json()


def test_byte_view_is_flat_bytes_without_a_copy():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    view = byte_view(a)
    assert len(view) == 24 and view.format == "B" and not view.readonly
    view[0:4] = np.float32(42).tobytes()
    assert a[0, 0] == 42  # shares memory
    assert bytes(byte_view(b"abc")) == b"abc" and len(byte_view(np.zeros(0, np.uint8))) == 0
