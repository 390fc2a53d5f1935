"""Qwen3-Next's layer kinds under ZeRO (docs/model.md, "Gated DeltaNet"): a hybrid decoder
(gated DeltaNet in layers 0 and 2, gated attention with partial rotary in layer 1, the gated
shared expert) at W = 2 with ep 2, ZeRO stages 0 and 3 in one spawn, computes what W = 1 does;
activation checkpointing trains it bit-identically."""

from __future__ import annotations

from moezero.config import Config
from tests.support.compare import assert_close_by_fqn
from tests.support.world import run_world
from tests.torch_impl.test_estimate import case
from tests.torch_impl.test_options import each_stage, options_config, two_steps
from tests.torch_impl.test_recompute import assert_runs_same, runs, with_and_without
from tests.torch_impl.tolerances import RTOL

HYBRID = dict(n_layers=3, n_heads=4, n_kv_heads=2, qk_norm="head", partial_rotary_factor=0.5,
              attn_output_gate=True, gated_delta_layers=[0, 2], linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
              linear_conv_kernel_dim=3, gated_delta_chunk=5)


def hybrid_config(ep: int) -> dict:
    cfg = options_config(ep).model_dump(by_alias=True)
    cfg["model"].update(HYBRID)
    return Config.model_validate(cfg).model_dump(by_alias=True)


def test_w2_ep2_equals_w1_with_gated_delta_layers(tmp_path):
    by_rank = run_world(each_stage, 2, tmp_path, hybrid_config(2), (0, 3))
    (single,) = run_world(two_steps, 1, tmp_path, hybrid_config(1), 0)
    assert "layers.0.linear_attn.in_proj_qkvz.weight" in single["params"]
    assert "layers.1.attn.wq.weight" in single["params"]
    for stage in (0, 3):
        ranks = [r[stage] for r in by_rank]
        for key in ("grads", "params"):
            assert_close_by_fqn({k: v for r in ranks for k, v in r[key].items()}, single[key],
                                RTOL["fp32"])


def test_activation_checkpointing_is_bit_identical_with_gated_delta_layers():
    bases = []
    for stage in (0, 3):
        base = case(stage)
        bases.append({**base, "model": {**base["model"], "n_heads": 4, "head_dim": 8,
                                        "attn_output_gate": True, "gated_delta_layers": [0],
                                        "linear_num_key_heads": 2, "linear_key_head_dim": 8,
                                        "linear_value_head_dim": 8, "gated_delta_chunk": 5}})
    assert_runs_same(runs(with_and_without(bases)))
