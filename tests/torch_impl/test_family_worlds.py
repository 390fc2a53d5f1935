"""The new families at W = 2 with ep 2 (issues 36, 37): gpt-oss (sinks, biases, alternating
sliding windows of 5 over 12-token rows), DeepSeek-V3 (MLA with ``q_lora_rank``, group-limited
sigmoid routing with ``n_group`` 4, one first-k dense layer, a shared expert), GLM-4.5 (partial
rotary, QK-norm, two shared experts), Qwen3-Next (a gated DeltaNet then a gated attention
layer, chunks of 5 over 12 tokens) and Qwen3.5-MoE's language model (the two kinds in the other
order; the import carries its vision tower), each a tiny random transformers 5 model (every
tensor and correction bias random) imported by ``import_hf``. Three steps from the import at
ZeRO stage 0; 1 with the optimizer on the CPU; 2 with it on NVMe; 3; 3 with params on the CPU;
3 with params and optimizer on NVMe (activation checkpointing in two of them, optimizer groups
and reduce buckets capped below an expert weight in three) give the losses, final weights
and expert biases of W = 1 at stage 0 on the same global batches.

One spawn of the W = 2 world runs every case of every family in turn, W = 1 runs in the test
process (slow: about 60 s of CPU with pytest's start, some 35 s of it the W = 2 world's ranks).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from moezero.checkpoint.hf import import_hf
from moezero.config import Config
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.plan import store
from moezero.train import build_model
from tests.support.compare import assert_close_by_fqn, rel_err
from tests.support.world import run_world
from tests.torch_impl.tolerances import RTOL

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

VOCAB, SEQ, MICRO, STEPS = 96, 12, 2, 3  # MICRO sequences per micro-batch, 2 per global batch
HF = {  # family: (transformers config class, model class, config fields)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=5, layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e3, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 8.0,
                         "beta_slow": 1.0, "truncate": False})),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=2,
        first_k_dense_replace=0, routed_scaling_factor=2.5, use_qk_norm=True,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                         "partial_rotary_factor": 0.5})),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
        linear_conv_kernel_dim=3, moe_intermediate_size=16, shared_expert_intermediate_size=12,
        intermediate_size=12, num_experts=4, num_experts_per_tok=2,
        partial_rotary_factor=0.5)),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", dict(
        text_config=dict(
            hidden_size=32, num_hidden_layers=2,
            layer_types=["full_attention", "linear_attention"], num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
            linear_conv_kernel_dim=3, moe_intermediate_size=16,
            shared_expert_intermediate_size=12, num_experts=4, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                             "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0],
                             "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2,
                           patch_size=4, out_hidden_size=32, num_position_embeddings=16,
                           temporal_patch_size=2, spatial_merge_size=2),
        image_token_id=90, video_token_id=91, vision_start_token_id=92,
        vision_end_token_id=93)),
}
MODEL = {"qwen3_next": {"gated_delta_chunk": 5}, "qwen3_5_moe": {"gated_delta_chunk": 5}}  # moezero's options beside the import's
CAP = 300  # moe.max_group_size and reduce_bucket_size: < an expert weight, so weights are sliced
CASES = {  # name: (ZeRO stage, offload_param device, offload_optimizer device, act. ckpt, cap)
    "stage0": (0, "none", "none", False, None),
    "stage1_optim_cpu": (1, "none", "cpu", False, CAP),
    "stage2_optim_nvme": (2, "none", "nvme", True, None),
    "stage3": (3, "none", "none", False, CAP),
    "stage3_params_cpu": (3, "cpu", "none", True, None),
    "stage3_params_optim_nvme": (3, "nvme", "nvme", False, CAP),
}


def hf_model(family: str):
    """A tiny random transformers model: on top of its own init, N(0, 0.1²) on every tensor
    (gains become 1 ± 0.1, biases and sinks nonzero) and every correction bias."""
    config_cls, model_cls, fields = HF[family]
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, max_position_embeddings=128)
    if "text_config" in fields:  # Qwen3.5-MoE: the language model's config is nested
        fields, sizes = {**fields, "text_config": {**fields["text_config"], **sizes}}, {}
    config = getattr(transformers, config_cls)(**sizes, **fields)
    model = getattr(transformers, model_cls)(config).float().eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


def case_config(ckpt: str, family: str, case: str, *, ep: int, nvme: str | None) -> dict:
    """The import's config with this case's ZeRO stage, offload and checkpointing, fp32,
    warmup off; ``ep`` 1 with stage 0 and nothing else is the W = 1 oracle."""
    stage, param, optim, recompute, cap = CASES[case]
    data = copy.deepcopy(store.read_manifest(store.find_checkpoint(ckpt)).config)
    data["model"].update(MODEL.get(family, {}))
    data["moe"].update(ep_size=ep, max_group_size=cap)
    data["precision"]["dtype"] = "fp32"
    data["optimizer"].update(lr=1e-3, warmup_steps=0)
    data["train"].update(seq_len=SEQ, micro_batch_size=MICRO, steps=STEPS)
    data["checkpoint"]["load"] = None
    data["activation_checkpointing"] = {"enabled": recompute, "every_n_layers": 1}
    zero = data["zero_optimization"]
    zero["stage"] = stage
    zero["reduce_bucket_size"] = cap or zero["reduce_bucket_size"]
    for key, device in (("offload_param", param), ("offload_optimizer", optim)):
        zero[key] = {"device": device, "nvme_path": nvme if device == "nvme" else None}
    return Config.model_validate(data).model_dump(by_alias=True)


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(0, VOCAB, (2 * MICRO, SEQ + 1), generator=gen) for _ in range(STEPS)]


def train(cfg_data: dict, ckpt: str) -> dict:
    """``STEPS`` steps from the import on this rank's micro-batches of each global batch (both,
    accumulated, at W = 1): the losses, this rank's full params and the expert biases."""
    cfg = Config.model_validate(cfg_data)
    topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    cfg.train.grad_accum_steps = 2 // topo.world_size
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
    engine.load_checkpoint(ckpt)
    losses, ce = [], []
    for batch in batches():
        metrics = engine.train_step(list(batch.split(MICRO)[topo.rank::topo.world_size]))
        losses.append(metrics["loss"])
        ce.append(metrics["ce"])
    params = {k: p.detach().clone().numpy() for k, p in engine.full_parameters().items()}
    params.update({k: b.clone().numpy() for k, b in engine.model.named_buffers()
                   if k.endswith("expert_bias")})
    engine.close()
    return {"losses": losses, "ce": ce, "params": params}


def run_jobs(jobs: dict[str, tuple[dict, str]]) -> dict:
    """Every job (``train`` arguments) in this world, in order; results by name."""
    return {name: train(*args) for name, args in jobs.items()}


@pytest.fixture(scope="module")
def models() -> dict:
    """Each family's tiny random transformers model."""
    return {family: hf_model(family) for family in HF}


@pytest.fixture(scope="module")
def imports(models, tmp_path_factory) -> dict[str, str]:
    """Each family's import-hf checkpoint root."""
    root = tmp_path_factory.mktemp("families")
    for family, model in models.items():
        model.save_pretrained(root / family / "hf")
        import_hf(root / family / "hf", root / family / "ckpt")
    return {family: str(root / family / "ckpt") for family in HF}


@pytest.fixture(scope="module")
def single(imports) -> dict:
    """W = 1, ZeRO stage 0, in this process: each family's oracle."""
    return {family: train(case_config(ckpt, family, "stage0", ep=1, nvme=None), ckpt)
            for family, ckpt in imports.items()}


@pytest.fixture(scope="module")
def w2(imports, tmp_path_factory) -> list[dict]:
    """One spawn of W = 2 running every case of every family; each rank's results."""
    nvme = str(tmp_path_factory.mktemp("swap"))
    jobs = {f"{family}/{case}": (case_config(ckpt, family, case, ep=2, nvme=nvme), ckpt)
            for family, ckpt in imports.items() for case in CASES}
    return run_world(run_jobs, 2, tmp_path_factory.mktemp("w2"), jobs, timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", list(HF))
def test_w2_ep2_equals_w1_stage0(w2, single, family, case):
    """Each step's loss (relative) and, on each rank, every param and expert bias it holds
    (norm-wise) within ``RTOL["fp32"]`` of W = 1; the ranks together hold every tensor."""
    want = single[family]
    ranks = [r[f"{family}/{case}"] for r in w2]
    assert len(ranks[0]["params"]) < len(want["params"])  # each rank holds half the experts
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"]  # the globally averaged loss
    loss_err = max(rel_err(got, loss) for got, loss in zip(ranks[0]["losses"], want["losses"],
                                                           strict=True))
    assert loss_err <= RTOL["fp32"], (ranks[0]["losses"], want["losses"])
    assert set().union(*(r["params"] for r in ranks)) == set(want["params"])
    worst = max(assert_close_by_fqn(r["params"], {k: want["params"][k] for k in r["params"]},
                                    RTOL["fp32"], f"{family} {case} rank {rank}")
                for rank, r in enumerate(ranks))  # dense params and expert biases: on each
    print(f"{family} {case}: losses {loss_err:.1e}, weights {worst:.1e} (relative)")


@pytest.mark.slow
def test_the_oracle_is_transformers_model_with_each_familys_options(models, single):
    """W = 1's first cross-entropy is transformers' on the same batch (the imported tensors
    were trained, not moezero's init); the imports built what the cases claim to exercise;
    training moved the loss."""
    first = batches()[0]
    for family, model in models.items():
        with torch.no_grad():
            logits = model(first[:, :-1]).logits
        theirs = F.cross_entropy(logits.flatten(0, 1), first[:, 1:].flatten()).item()
        assert rel_err(single[family]["ce"][0], theirs) <= RTOL["fp32"], family
    names = {family: set(result["params"]) for family, result in single.items()}
    assert {"layers.0.attn.sinks", "layers.0.moe.experts.3.w2.bias"} <= names["gpt_oss"]
    assert {"layers.0.attn.q_a_proj.weight", "layers.0.mlp.w1.weight",
            "layers.1.moe.router.expert_bias"} <= names["deepseek_v3"]
    assert {"layers.0.attn.q_norm.weight", "layers.1.shared.w1.weight"} <= names["glm4_moe"]
    assert {"layers.0.linear_attn.in_proj_qkvz.weight",
            "layers.1.attn.wq.weight"} <= names["qwen3_next"]
    assert {"layers.0.attn.wq.weight",
            "layers.1.linear_attn.in_proj_qkvz.weight"} <= names["qwen3_5_moe"]
    for result in single.values():
        assert result["losses"][-1] != result["losses"][0]
