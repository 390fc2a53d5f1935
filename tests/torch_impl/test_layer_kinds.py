"""Layer kinds (torch_impl/model/kind.py, kinds.py): a block composes the attention and MLP
kinds its layer takes; the dense SwiGLU kind (``model.first_k_dense``) at ``layers.N.mlp``:
its FQNs and Hugging Face names, its params in the plan's dense groups with the expert groups
of the other layers named as before, the aux loss of MoE layers only, LoRA on ``mlp``, the
config's one-line refusals, the export's refusal, the estimate's count, W = 2 ep 2 equal to
W = 1 and activation checkpointing bit-identical."""

from __future__ import annotations

import pytest
import torch

from moezero.checkpoint.hf.arch import Arch
from moezero.checkpoint.hf.families import FAMILIES, family_for
from moezero.checkpoint.hf.names import hf_name
from moezero.config import Config, ConfigError, load_config
from moezero.distributed.topology import build_topology
from moezero.estimate import estimate
from moezero.model import Decoder, model_args
from moezero.model.build import build_decoder
from moezero.model.dense import DenseMLP
from moezero.model.kinds import ATTENTION_KINDS, MLP_KINDS, hf_layer_names
from moezero.model.lora import LoraOptions
from moezero.model.materialize import KeyedInit
from moezero.plan.store import CheckpointError
from moezero.zero.groups import build_groups
from tests.support.compare import assert_close_by_fqn
from tests.support.world import run_world
from tests.torch_impl.test_estimate import case
from tests.torch_impl.test_options import each_stage, options_config, two_steps
from tests.torch_impl.test_recompute import assert_runs_same, runs, with_and_without
from tests.torch_impl.tolerances import RTOL

MODEL = {"vocab_size": 64, "dim": 32, "n_layers": 3, "n_heads": 2, "ffn_dim": 24}
MOE = {"num_experts": 4, "top_k": 2, "ep_size": 1}


def config(**model) -> Config:
    return Config.model_validate({"model": {**MODEL, **model}, "moe": MOE,
                                  "data": {"synthetic_vocab": 32}})


def decoder(cfg: Config, lora: LoraOptions | None = None) -> Decoder:
    return build_decoder(model_args(cfg), where="cpu", lora=lora, init=KeyedInit(0))


def test_first_k_layers_take_the_dense_kind_under_mlp():
    model = decoder(config(first_k_dense=2, dense_ffn_dim=40))
    kinds = [(b.attention_kind.name, b.mlp_kind.name) for b in model.layers]
    assert kinds == [("gqa", "dense"), ("gqa", "dense"), ("gqa", "moe")]
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters() if k.startswith("layers.1.")}
    assert shapes == {"layers.1.attn_norm.weight": (32,), "layers.1.attn.wq.weight": (32, 32),
                      "layers.1.attn.wk.weight": (32, 32), "layers.1.attn.wv.weight": (32, 32),
                      "layers.1.attn.wo.weight": (32, 32), "layers.1.ffn_norm.weight": (32,),
                      "layers.1.mlp.w1.weight": (40, 32), "layers.1.mlp.w3.weight": (40, 32),
                      "layers.1.mlp.w2.weight": (32, 40)}
    assert any(k.startswith("layers.2.moe.experts.3.") for k in dict(model.named_parameters()))
    assert isinstance(decoder(config(first_k_dense=1)).layers[0].mlp, DenseMLP)
    assert decoder(config(first_k_dense=1)).layers[0].mlp.w1.weight.shape == (24, 32)


def test_aux_loss_total_is_the_moe_layers_only():
    model = decoder(config(first_k_dense=2))
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    _, aux = model(tokens)
    h, want = model.embed(tokens), torch.zeros(())
    for block in model.layers:
        h, layer_aux = block(h)
        assert (layer_aux is None) == (block.mlp_kind.name == "dense")
        want = want if layer_aux is None else want + layer_aux
    assert aux.item() == want.item() > 0


def test_dense_params_are_in_dense_groups_and_expert_groups_keep_their_names():
    topo = build_topology([1], num_experts=4)
    with_dense, without = config(first_k_dense=1), config()
    plan = build_groups(decoder(with_dense), with_dense, topo).plan
    dense_fqns = {m.fqn for g in plan if not g.is_expert for m in g.members}
    assert {"layers.0.mlp.w1.weight", "layers.0.mlp.w2.weight"} <= dense_fqns
    assert not any(".mlp." in m.fqn for g in plan if g.is_expert for m in g.members)
    expert = {g.name for g in plan if g.is_expert}
    before = {g.name for g in build_groups(decoder(without), without, topo).plan if g.is_expert}
    assert expert == {n for n in before if "layers.0." not in n} and len(expert) == 2 * 4


def test_lora_targets_the_dense_mlp_by_its_owner_name():
    cfg = config(first_k_dense=1)
    model = decoder(cfg, LoraOptions(r=2, targets=("mlp.w1", "attn.wq", "experts.w2")))
    adapters = {k.removesuffix(".lora_A") for k in dict(model.named_parameters())
                if k.endswith("lora_A")}
    assert adapters == {"layers.0.mlp.w1", *[f"layers.{i}.attn.wq" for i in range(3)],
                        *[f"layers.{i}.moe.experts.{e}.w2" for i in (1, 2) for e in range(4)]}


@pytest.mark.parametrize(("sets", "key"), [
    (["model.first_k_dense=4"], "model.first_k_dense: must be < model.n_layers (4)"),
    (["model.dense_ffn_dim=0"], "model.dense_ffn_dim"),
    (["peft.method=lora", "peft.targets=[mlp]"], "peft.targets: names the dense MLP")])
def test_config_refuses_in_one_line(sets, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, sets)
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_hf_names_are_declared_beside_each_kind_without_clashes():
    assert set(ATTENTION_KINDS) == {"gqa", "mla", "gated_delta"} and set(MLP_KINDS) == {"moe", "dense"}
    names = hf_layer_names("block_sparse_moe")
    assert names["moe.router.weight"] == "block_sparse_moe.gate.weight"
    family = FAMILIES["qwen2_moe"]
    assert hf_name("layers.0.mlp.w1.weight", family) == "model.layers.0.mlp.gate_proj.weight"
    assert hf_name("layers.4.mlp.w3.weight", family) == "model.layers.4.mlp.up_proj.weight"
    assert hf_name("layers.4.mlp.w2.weight", family) == "model.layers.4.mlp.down_proj.weight"
    assert hf_name("layers.1.attn.wq.bias", family) == "model.layers.1.self_attn.q_proj.bias"


def test_export_refuses_dense_layers_in_one_line():
    arch = Arch(64, 32, 3, 2, 24, 1e4, 1e-5, 4, 2, 2, 16, first_k_dense=1)
    with pytest.raises(CheckpointError, match="model.first_k_dense=1 cannot be exported"):
        family_for(arch)


def test_estimate_counts_the_dense_layers():
    d, f, dense_f = 32, 24, 40
    est, base = estimate(config(first_k_dense=1, dense_ffn_dim=dense_f), 1), estimate(config(), 1)
    moe_layer = 4 * 3 * d * f + 4 * d  # experts + router
    assert est.model_numel - base.model_numel == 3 * d * dense_f - moe_layer


def dense_config(ep: int) -> dict:
    cfg = options_config(ep).model_dump(by_alias=True)
    cfg["model"].update(n_layers=3, first_k_dense=1, dense_ffn_dim=40)
    return cfg


def test_w2_ep2_equals_w1_with_a_dense_first_layer(tmp_path):
    """A dense first layer before two MoE layers (every option on): W = 2 with ep 2 at ZeRO 0
    and 3 computes what W = 1 does, the dense params averaged over both ranks."""
    by_rank = run_world(each_stage, 2, tmp_path, dense_config(2), (0, 3))
    (single,) = run_world(two_steps, 1, tmp_path, dense_config(1), 0)
    assert "layers.0.mlp.w2.weight" in single["params"]
    assert not any(k.startswith("layers.0.moe.") for k in single["params"])
    for stage in (0, 3):
        ranks = [r[stage] for r in by_rank]
        for key in ("grads", "params"):
            assert_close_by_fqn({k: v for r in ranks for k, v in r[key].items()}, single[key],
                                RTOL["fp32"])


def test_activation_checkpointing_is_bit_identical_with_dense_layers():
    """A dense block 0 and an MoE block 1, both checkpointed (every block) or the dense one
    only (every second block), train bit-identically to no checkpointing, at stages 0 and 3."""
    bases = [{**case(stage), "model": {**case(stage)["model"], "first_k_dense": 1}}
             for stage in (0, 3)]
    assert_runs_same(runs(with_and_without(bases)))
