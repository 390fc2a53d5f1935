"""The expert bias (a router buffer) in the run ``moezero train`` starts: the model built on the
meta device (``train.setup``) and materialised by the engine. Training starts at ZeRO 0 and 3,
with LoRA, at W = 1 and at W = 2 with ep 2, and a resume from the checkpoint (the biases are
in its ``buffers.safetensors``) ends with the biases of the uninterrupted run.

Before the fix the engine's ``model.to`` met the router's buffers still on the meta device
("Cannot copy out of meta tensor"): the other expert-bias tests build the model materialised
(``train.build_model``), which never made them meta.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from moezero.config import Config, load_config
from moezero.plan import store
from moezero.train import train
from tests.support.world import run_world

SETS = ["model.dim=16", "model.n_layers=2", "model.n_heads=2", "model.ffn_dim=16",
        "moe.num_experts=4", "train.seq_len=16", "train.micro_batch_size=2",
        "train.eval_every=0", "train.log_every=100", "checkpoint.every=0",
        "moe.expert_bias=true", "moe.bias_update_rate=0.01", "precision.dtype=fp32"]
STEPS, FIRST = 4, 2  # the uninterrupted run's steps; the interrupted run saves after FIRST


def biases(cfg_data: dict, run_dir: str, steps: int, load: str | None = None) -> dict:
    """``moezero.train.train`` ``steps`` steps (resuming ``load``): the expert biases its final
    checkpoint holds, by FQN."""
    cfg = Config.model_validate(cfg_data)
    cfg.train.steps, cfg.checkpoint.load = steps, load
    train(cfg, run_dir)
    step = store.find_latest(cfg.checkpoint.resolve_dir(run_dir))
    return {k: v for k, v in load_file(step / "buffers.safetensors").items()
            if k.endswith("expert_bias")}


def whole_and_resumed(cfg_data: dict, root: str) -> tuple[dict, dict, dict]:
    """The biases of ``STEPS`` steps in one run, of its first ``FIRST`` steps in a run of its
    own, and of that run resumed to ``STEPS``."""
    whole = biases(cfg_data, str(Path(root, "whole")), STEPS)
    first = biases(cfg_data, str(Path(root, "parts")), FIRST)
    return whole, first, biases(cfg_data, str(Path(root, "parts")), STEPS, load="latest")


def config(*extra: str) -> dict:
    return load_config(None, [*SETS, *extra]).model_dump(by_alias=True)


def check(whole: dict, first: dict, resumed: dict) -> None:
    assert sorted(whole) == [f"layers.{i}.moe.router.expert_bias" for i in range(2)]
    assert any(np.any(b != 0) for b in first.values())  # the resume has biases to restore
    assert any(np.any(b != first[k]) for k, b in whole.items())  # and moved on after it
    for k, b in whole.items():
        np.testing.assert_array_equal(resumed[k], b, err_msg=k)


# Stage 3 (the model materialised shard by shard) is the W = 2 case below, which runs the same
# meta build and resume at stage 3 with ep 2 (a W = 1 stage 3 cell of its own was three more
# runs on that path; CI time). W = 1 keeps the replicated stage 0 and LoRA (stage 2).
@pytest.mark.parametrize("extra", [
    ("moe.ep_size=1", "zero_optimization.stage=0"),
    ("moe.ep_size=1", "zero_optimization.stage=2", "peft.method=lora",
     "peft.targets=[attn, experts]"),
], ids=["stage0", "lora"])
def test_a_meta_built_run_trains_and_resumes_its_biases_at_w1(tmp_path, extra):
    check(*whole_and_resumed(config(*extra), str(tmp_path)))


def test_a_meta_built_run_trains_and_resumes_its_biases_at_w2_ep2(tmp_path):
    cfg = config("moe.ep_size=2", "zero_optimization.stage=3")
    by_rank = run_world(whole_and_resumed, 2, tmp_path, cfg, str(tmp_path / "runs"))
    check(*by_rank[0])
    assert by_rank[1][0].keys() == by_rank[0][0].keys()  # rank 1 read the same checkpoints
