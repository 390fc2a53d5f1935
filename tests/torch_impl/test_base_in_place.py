"""A LoRA run at stage 3 with ``offload_param.device: nvme`` reads its frozen base where it
lies (``moezero.offload.base_params``, docs/finetune.md): from a bf16 import's own files, upcast
for fp32 compute, with no swap file for a frozen param. At W = 2, ep 2 it equals, bit for bit,
the same run with the base in host memory (``offload_param.device: cpu``) and the run that
copies the base to swap files; a base file changed during the run is refused in one line.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from moezero.checkpoint.adapter_ckpt import check_same
from moezero.checkpoint.core import CheckpointError
from moezero.cli import main
from moezero.config import Config, ConfigError
from moezero.data import Batches, make_corpus
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.model.materialize import KeyedInit
from moezero.offload.aio import AsyncIO
from moezero.offload.state import check_paths
from moezero.plan import store
from moezero.train import build_model, frozen_base, sharded_model
from tests.support.hf import save_hf
from tests.support.world import run_world
from tests.torch_impl.test_distributed import MICRO
from tests.torch_impl.test_hf_families import hf_model

pytest.importorskip("transformers")
STEPS = 3


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE in bf16, imported as it is (bf16)."""
    root = tmp_path_factory.mktemp("base_in_place")
    src = save_hf(hf_model("qwen3_moe").to(torch.bfloat16), root / "hf")
    assert main(["import-hf", str(src), "--out", str(root / "base")]) == 0
    step = store.find_checkpoint(root / "base")
    assert store.read_manifest(step).layout.dtype == "BF16"
    return step


def lora_cfg(step: Path, param: str, nvme: str, dtype: str = "fp32",
             by_layer: bool = False) -> dict:
    cfg = dict(store.read_manifest(step).config)
    cfg["moe"] = {**cfg["moe"], "split_dense_by_layer": by_layer}
    cfg["peft"] = {"method": "lora", "r": 4, "alpha": 8.0, "targets": ["attn", "experts"]}
    cfg["train"] = {**cfg["train"], "seq_len": 16, "micro_batch_size": MICRO}
    cfg["optimizer"] = {**cfg["optimizer"], "lr": 1e-2}
    cfg["precision"] = {**cfg["precision"], "dtype": dtype}
    cfg["zero_optimization"] = {
        **cfg["zero_optimization"], "stage": 3,
        "offload_optimizer": {"device": "cpu", "nvme_path": None},
        "offload_param": {"device": param, "nvme_path": nvme if param == "nvme" else None}}
    cfg["checkpoint"] = {**cfg["checkpoint"], "load": str(step)}
    return cfg


def run(cfg_data: dict, base: str | None, change: str | None = None) -> dict:
    """STEPS LoRA steps on this rank's slices of a global batch of 2 micro-batches; losses,
    full params, the param swap files and bytes written to them. ``change``: a base file
    whose mtime is moved after the first step (the second step's error is returned)."""
    cfg = Config.model_validate(cfg_data)
    topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    cfg.train.grad_accum_steps = 2 // topo.world_size
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu",
                        base=Path(base) if base else None)
    engine.load_checkpoint(cfg.checkpoint.load)
    batches = Batches(make_corpus(None, vocab=32, sources=2, seed=7), seed=3, dp_rank=0,
                      dp_size=1, global_batch=MICRO * 2, seq_len=cfg.train.seq_len)
    losses, error = [], None
    for step in range(STEPS):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        try:
            losses.append(engine.train_step(list(slices[topo.rank::topo.world_size]))["loss"])
        except CheckpointError as exc:
            error = str(exc)
            break
        if change and step == 0:
            os.utime(change, ns=(os.stat(change).st_atime_ns, os.stat(change).st_mtime_ns + 1))
    swap = engine.optimizer.param_swap
    out = {"losses": losses, "error": error,
           "params": {k: p.detach().float().clone().numpy()
                      for k, p in engine.full_parameters().items()}
           if error is None else {},
           "files": swap.folder.listing() if swap else [],
           "groups": [s.group.name for s in engine.optimizer.slots],
           "written": swap.traffic["write"] if swap else 0}
    engine.close()
    return out


def cases(calls: dict) -> dict:
    return {name: run(*args) for name, args in calls.items()}


@pytest.fixture(scope="module")
def w2(base, tmp_path_factory):
    swap = tmp_path_factory.mktemp("swap")
    calls = {"memory": (lora_cfg(base, "cpu", ""), None),
             "copied": (lora_cfg(base, "nvme", str(swap / "copied")), None),
             "in_place": (lora_cfg(base, "nvme", str(swap / "in_place")), str(base)),
             "by_layer": (lora_cfg(base, "nvme", str(swap / "by_layer"), by_layer=True),
                          str(base))}
    for name in ("copied", "in_place", "by_layer"):
        (swap / name).mkdir()
    return run_world(cases, 2, tmp_path_factory.mktemp("w2"), calls, timeout_s=300)


def test_in_place_equals_the_base_in_memory_bit_for_bit(w2):
    for rank in w2:
        memory = rank["memory"]
        assert any(f.endswith("lora_B") and np.any(v != 0) for f, v in memory["params"].items())
        for name in ("copied", "in_place", "by_layer"):
            assert rank[name]["losses"] == memory["losses"], name
            assert memory["params"].keys() == rank[name]["params"].keys()
            for fqn, value in memory["params"].items():
                assert np.array_equal(rank[name]["params"][fqn].view(np.uint32),
                                      value.view(np.uint32)), (name, fqn)


@pytest.mark.slow  # bf16 matmuls on a CPU: about 15 s of the CI's scarce time
def test_bf16_compute_reads_the_bf16_base_straight_in_bit_for_bit(base, tmp_path):
    """bf16 compute (a GPU's) at W = 1: the shards are read straight into their buffers."""
    (tmp_path / "swap").mkdir()
    one = lambda cfg: {**cfg, "moe": {**cfg["moe"], "ep_size": 1}}
    calls = {"memory": (one(lora_cfg(base, "cpu", "", "bf16")), None),
             "in_place": (one(lora_cfg(base, "nvme", str(tmp_path / "swap"), "bf16")),
                          str(base))}
    (res,) = run_world(cases, 1, tmp_path, calls, timeout_s=300)
    assert res["in_place"]["losses"] == res["memory"]["losses"]
    assert not any("frozen" in n for n, _ in res["in_place"]["files"])
    for fqn, value in res["memory"]["params"].items():
        assert np.array_equal(res["in_place"]["params"][fqn].view(np.uint32),
                              value.view(np.uint32)), fqn


def test_no_swap_file_is_written_for_a_frozen_param(w2):
    for rank in w2:
        copied, in_place = rank["copied"]["files"], rank["in_place"]["files"]
        frozen = [(n, s) for n, s in copied if "frozen" in n]
        assert frozen and not any("frozen" in n for n, _ in in_place)
        assert sorted(in_place) == sorted(set(copied) - set(frozen))  # the adapters' files
        assert rank["in_place"]["written"] < rank["copied"]["written"]
        # a dense group per block, read from the import's one dense group: no swap file either
        assert "dense/layers.1/decay/0" in rank["by_layer"]["groups"]  # the adapters
        assert "dense/decay/0" in rank["in_place"]["groups"]
        assert not any("frozen" in n for n, _ in rank["by_layer"]["files"])
        print(f"param swap files: copied {len(copied)} files, {sum(s for _, s in copied):,} B; "
              f"in place {len(in_place)} files, {sum(s for _, s in in_place):,} B; bytes "
              f"written {rank['copied']['written']:,} vs {rank['in_place']['written']:,}")


def drawn_at_init(cfg_data: dict, base: str | None) -> list[str]:
    """The FQNs whose initial value is drawn while an engine is built the way ``train.setup``
    builds it (sharded construction: on the meta device, each shard filled from its draw)."""
    cfg = Config.model_validate(cfg_data)
    topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    model, init = sharded_model(cfg, topo)
    drawn, draw = [], KeyedInit.value

    def counted(keyed, fqn, shape):
        drawn.append(fqn)
        return draw(keyed, fqn, shape)

    with mock.patch.object(KeyedInit, "value", counted):
        engine = initialize(model, cfg, topology=topo, device="cpu", init=init,
                            base=Path(base) if base else None)
    engine.close()
    return drawn


def both_drawn(copied: tuple, in_place: tuple) -> dict:
    return {"copied": drawn_at_init(*copied), "in_place": drawn_at_init(*in_place)}


def test_a_frozen_param_read_in_place_is_never_drawn_at_init(base, tmp_path):
    """Its values are its base's, loaded before the first step: drawing them (for the 16 B
    base, 7.8 B normal draws per rank, whole fp32 tensors of up to 1.2 GB) is time and memory
    for nothing. A run that copies its base to swap files still draws its shards first."""
    one = lambda cfg: {**cfg, "moe": {**cfg["moe"], "ep_size": 1}}
    for name in ("copied", "in_place"):
        (tmp_path / name).mkdir()
    (res,) = run_world(both_drawn, 1, tmp_path,
                       (one(lora_cfg(base, "nvme", str(tmp_path / "copied"))), None),
                       (one(lora_cfg(base, "nvme", str(tmp_path / "in_place"))), str(base)),
                       timeout_s=300)
    base_params = {name: {f for f in drawn if "lora_" not in f} for name, drawn in res.items()}
    assert base_params["copied"]
    assert not base_params["in_place"], sorted(base_params["in_place"])[:3]


def test_a_base_file_changed_during_the_run_is_refused_in_one_line(base, tmp_path):
    (tmp_path / "swap").mkdir()
    cfg = lora_cfg(base, "nvme", str(tmp_path / "swap"))
    cfg["moe"] = {**cfg["moe"], "ep_size": 1}
    target = str(base / store.read_manifest(base).layout.model_files[0].name)
    (res,) = run_world(run, 1, tmp_path, cfg, str(base), target, timeout_s=120)
    assert len(res["losses"]) == 1 and res["error"] is not None
    line = res["error"]
    assert "\n" not in line and line.startswith(f"{target}: the base checkpoint's file changed "
                                                "during the run"), line


def test_another_base_than_the_one_read_in_place_is_refused_and_nothing_is_written(tmp_path):
    check_same(None, tmp_path)  # nothing read in place: any base
    check_same(tmp_path / "a" / ".." / "a", tmp_path / "a")
    with pytest.raises(CheckpointError) as err:
        check_same(tmp_path / "a", tmp_path / "b")
    assert "\n" not in str(err.value) and "read in place from" in str(err.value)
    (tmp_path / "f").write_bytes(bytes(8))
    with AsyncIO(readonly=True) as io:
        with pytest.raises(ValueError, match="read-only"):
            io.write(tmp_path / "f", torch.ones(2))
        out = torch.ones(2)
        io.read(tmp_path / "f", out).result()
    assert out.tolist() == [0.0, 0.0]


def test_train_reads_in_place_only_a_lora_run_at_stage_3_with_params_on_nvme(base, tmp_path):
    cfg = Config.model_validate(lora_cfg(base, "nvme", str(tmp_path)))
    assert frozen_base(cfg, tmp_path) == base
    cfg.checkpoint.load = str(base.parent)  # a root: its newest checkpoint
    assert frozen_base(cfg, tmp_path) == base
    assert frozen_base(Config.model_validate(lora_cfg(base, "cpu", "")), tmp_path) is None
    no_lora = lora_cfg(base, "nvme", str(tmp_path))
    no_lora["peft"] = {"method": "none"}
    assert frozen_base(Config.model_validate(no_lora), tmp_path) is None
    stage2 = lora_cfg(base, "cpu", "")
    stage2["zero_optimization"] = {**stage2["zero_optimization"], "stage": 2,
                                   "offload_param": {"device": "none", "nvme_path": None}}
    assert frozen_base(Config.model_validate(stage2), tmp_path) is None


def test_the_space_check_before_launch_needs_no_room_for_a_base_read_in_place(tmp_path):
    cfg = Config.model_validate({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}})
    numel = shutil.disk_usage(tmp_path).free // 4 + 1  # its param files would not fit
    check_paths(cfg.zero_optimization, numel=numel, share=1.0, param_bytes=4,
                frozen=numel - 16, in_place=True)
    with pytest.raises(ConfigError, match="offload_param.nvme_path"):
        check_paths(cfg.zero_optimization, numel=numel, share=1.0, param_bytes=4,
                    frozen=numel - 16)
