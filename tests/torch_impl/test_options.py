"""The decoder and router options of the Hugging Face families (docs/model.md): the router
variants and the expert bias on their own, the config's checks, W = 2 with ep 2 equal to W = 1
with every option on, and the expert bias through a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moezero.config import Config, ConfigError, load_config
from moezero.data import Batches, make_corpus
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.model.build import build_decoder, config_decoder
from moezero.model.decoder import ModelArgs
from moezero.model.router import Router, RouterOptions, route, update_expert_biases
from moezero.model.specs import config_user_group, param_specs
from moezero.plan import plan_groups, store
from moezero.train import build_model
from tests.support.compare import assert_close_by_fqn, rel_err
from tests.support.world import run_world
from tests.torch_impl.tolerances import RTOL

MICRO = 2  # sequences per rank
EVERY_OPTION = {"model": {"n_heads": 4, "n_kv_heads": 2, "qk_norm": "head", "attn_bias": "qkv"},
                "moe": {"router_scoring": "sigmoid", "expert_bias": True, "renormalize": False,
                        "shared_ffn_dim": 24, "shared_gate": True, "bias_update_rate": 0.01,
                        "n_group": 2, "topk_group": 2, "routed_scaling_factor": 1.5}}


def test_sigmoid_gates_are_raw_scores_unless_renormalised():
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0]])
    probs, gates, experts = route(logits, 2, scoring="sigmoid", renormalize=False)
    assert experts.tolist() == [[0, 3]]
    torch.testing.assert_close(gates, torch.sigmoid(torch.tensor([[2.0, 1.0]])))
    torch.testing.assert_close(probs.sum(-1), torch.ones(1))  # the aux loss's P: normalised
    _, gates, _ = route(logits, 2, scoring="sigmoid")
    torch.testing.assert_close(gates.sum(-1), torch.ones(1))


def test_expert_bias_steers_the_choice_but_not_the_gates():
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 10.0, 0.0])
    _, gates, experts = route(logits, 2, scoring="sigmoid", renormalize=False, bias_E=bias)
    assert experts.tolist() == [[2, 0]]
    torch.testing.assert_close(gates, torch.sigmoid(torch.tensor([[-1.0, 2.0]])))


def test_expert_bias_stays_fp32_and_counts_training_forwards_only():
    router = Router(8, 4, 2, RouterOptions(expert_bias=True, bias_update_rate=0.25))
    router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        router(x)  # evaluation: not a load
    assert router.pending_load.sum() == 0
    router(x)
    assert router.pending_load.sum() == 12  # 6 tokens x top-2
    load = router.pending_load.clone()
    update_expert_biases(router, distributed=False)
    want = 0.25 * torch.sign(load.sum() - 4 * load).float()
    assert torch.equal(router.expert_bias, want) and router.pending_load.sum() == 0
    router(x)
    update_expert_biases(router, distributed=False, skip=True)  # a skipped (overflow) step
    assert torch.equal(router.expert_bias, want) and router.pending_load.sum() == 0


@pytest.mark.parametrize("sets,where", [
    (["model.n_heads=4", "model.n_kv_heads=3"], "model.n_kv_heads: must divide model.n_heads"),
    (["model.head_dim=7"], "model.head_dim: head dim 7 must be even"),
    (["moe.shared_gate=true"], "moe.shared_gate: needs a shared expert"),
    (["model.qk_norm=rms"], "model.qk_norm: Input should be 'none', 'head' or 'projection'"),
])
def test_bad_options_are_one_line(sets, where):
    with pytest.raises(ConfigError) as err:
        load_config(None, sets)
    assert str(err.value).startswith(where) and "\n" not in str(err.value)


def test_gqa_is_mha_with_repeated_kv_heads():
    """Query head h reads key/value head h // (H/G), as transformers' repeat_kv."""
    gqa = build_decoder(ModelArgs(dim=16, n_heads=4, n_kv_heads=2, attn_bias="all"),
                        where="cpu").layers[0].attn
    mha = build_decoder(ModelArgs(dim=16, n_heads=4, attn_bias="all"), where="cpu").layers[0].attn
    with torch.no_grad():
        for name, p in gqa.named_parameters():
            p.normal_(0, 0.2)
            value = p if name[:2] not in ("wk", "wv") else p.view(2, 4, -1).repeat_interleave(
                2, dim=0).reshape(16, -1).squeeze(-1)
            mha.get_parameter(name).copy_(value)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-6, atol=1e-6)


def test_head_dim_need_not_divide_dim():
    cfg = load_config(None, ["model.dim=48", "model.n_heads=5", "model.head_dim=16"])
    model = build_decoder(ModelArgs(dim=48, n_heads=5, n_kv_heads=1, head_dim=16), where="meta")
    assert cfg.model.head_dim == 16
    assert model.layers[0].attn.wq.weight.shape == (80, 48)
    assert model.layers[0].attn.wk.weight.shape == (16, 48)


# ------------------------------------------------------------------------- W = 2 vs W = 1


def options_config(ep: int) -> Config:
    cfg = Config()
    cfg.model = cfg.model.model_copy(update={"dim": 32, "n_layers": 2, "ffn_dim": 48,
                                             **EVERY_OPTION["model"]})
    cfg.train = cfg.train.model_copy(update={"seq_len": 16, "micro_batch_size": MICRO,
                                             "steps": 4})
    cfg.moe = cfg.moe.model_copy(update={"num_experts": 4, "ep_size": ep, **EVERY_OPTION["moe"]})
    cfg.precision.dtype = "fp32"
    return Config.model_validate(cfg.model_dump(by_alias=True))


def two_steps(cfg_data: dict, stage: int) -> dict:
    """Two optimizer steps on a global batch of 2 x MICRO sequences split over this run's ranks
    (accumulated at W = 1): grads of the first, params and expert biases after both."""
    cfg = Config.model_validate(cfg_data)
    cfg.zero_optimization.stage = stage
    topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    cfg.train.grad_accum_steps = 2 // topo.world_size
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
    batches = Batches(make_corpus(None, vocab=32, sources=2, seed=7), global_batch=2 * MICRO,
                      seq_len=cfg.train.seq_len, seed=3, dp_rank=0, dp_size=1)
    grads = None
    for _ in range(2):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        for batch in slices[topo.rank::topo.world_size]:
            engine.backward(engine.forward(batch)[0])
        engine.reduce_gradients()
        grads = grads or {k: g.clone().numpy() for k, g in engine.gradients().items()}
        engine.optimizer_step()
    params = {k: p.detach().clone().numpy() for k, p in engine.full_parameters().items()}
    biases = {k: b.clone().numpy() for k, b in engine.model.named_buffers()
              if k.endswith("expert_bias")}
    return {"grads": grads, "params": params, "biases": biases}


def each_stage(cfg_data: dict, stages: tuple[int, ...]) -> dict:
    return {stage: two_steps(cfg_data, stage) for stage in stages}


def test_w2_ep2_equals_w1_with_every_option(tmp_path):
    """GQA, QK-norm, biases, sigmoid routing with an expert bias, a gated shared expert: W = 2
    with ep 2 (ZeRO 0 and 2) computes what W = 1 does, the biases updated from global loads."""
    by_rank = run_world(each_stage, 2, tmp_path, options_config(2).model_dump(by_alias=True),
                        (0, 2))
    (single,) = run_world(two_steps, 1, tmp_path, options_config(1).model_dump(by_alias=True), 0)
    assert any(np.any(b != 0) for b in single["biases"].values())
    for stage in (0, 2):
        ranks = [r[stage] for r in by_rank]
        for key in ("grads", "params"):
            assert_close_by_fqn({k: v for r in ranks for k, v in r[key].items()}, single[key],
                                RTOL["fp32"])
        for r in ranks:  # every rank holds the same biases, equal to the single run's
            assert r["biases"].keys() == single["biases"].keys()
            for k, v in single["biases"].items():
                np.testing.assert_array_equal(r["biases"][k], v, err_msg=k)
    assert rel_err(by_rank[0][0]["params"]["layers.0.shared.gate.weight"],
                   single["params"]["layers.0.shared.gate.weight"]) <= RTOL["fp32"]


# --------------------------------------------------------------------------- checkpoints


def engine_of(cfg: Config):
    topo = build_topology([1], num_experts=cfg.moe.num_experts)
    return initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")


def test_expert_bias_is_checkpointed_and_resumed(tmp_path):
    cfg = options_config(1)
    cfg.zero_optimization.stage = 1
    engine = engine_of(cfg)
    for seed in (1, 2):
        batch = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(seed))
        engine.train_step([batch])
    saved = {k: b.clone() for k, b in engine.model.named_buffers() if k.endswith("expert_bias")}
    assert len(saved) == 2 and any(b.any() for b in saved.values())
    step = engine.save_checkpoint(tmp_path)
    manifest = store.read_manifest(step)
    assert (step / "buffers.safetensors").is_file() and store.verify(step) == []
    assert dict(manifest.layout.buffers) == {k: (4,) for k in saved}
    assert not any(m.fqn.endswith("expert_bias") for g in manifest.layout.groups
                   for m in g.members)  # in no optimizer group
    fresh = engine_of(cfg)
    fresh.load_checkpoint(tmp_path)
    for k, b in fresh.model.named_buffers():
        if k in saved:
            assert torch.equal(b, saved[k]), k
    cfg.moe.expert_bias = False
    with pytest.raises(store.CheckpointError, match="has buffer layers.0.moe.router.expert_bias "
                                                    "that the model does not"):
        engine_of(cfg).load_checkpoint(tmp_path)


# ------------------------------------------------------------------------------- grouping


def test_groups_of_the_new_parameters():
    """Shared experts are dense (every rank holds them); QK-norm gains and attention biases
    get no weight decay, as norm gains; the expert bias is in no optimizer group."""
    cfg = options_config(2)
    specs, user_groups = param_specs(config_decoder(cfg, where="meta"), config_user_group(cfg))
    groups = plan_groups(specs)
    group_of = {m.fqn: g for g in groups for m in g.members}
    assert not any(k.endswith("expert_bias") for k in group_of)
    shared = [k for k in group_of if ".shared." in k]
    assert len(shared) == 2 * 4 and all(not group_of[k].is_expert for k in shared)
    decay = {ug.name: ug.as_dict()["weight_decay"] for ug in user_groups}
    for k, g in group_of.items():
        no_decay = k.endswith(("norm.weight", ".bias"))
        assert (decay[g.user_group] == 0.0) == no_decay, k
    assert {"layers.0.attn.q_norm.weight", "layers.0.attn.wk.bias"} <= set(group_of)
