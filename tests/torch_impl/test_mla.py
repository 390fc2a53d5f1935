"""Multi-head latent attention (``model.attention: mla``, torch_impl/model/mla.py) against
transformers' ``DeepseekV3Attention``, run independently on the same random weights (every
weight random, norm gains off 1, biases off 0): outputs within 1e-5 at fp32 with and without
``q_lora_rank``, with and without ``rope_interleave``, with biases and YaRN's softmax factor,
on a sequence length that is not a power of two, and with a document mask against each
document run alone. Beside it: the layer kind's FQNs and Hugging Face names, the config's
refusals, LoRA on its projections under deepseek_v3's module names, and the export refusal.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
    yarn_get_mscale,
)

from moezero.checkpoint.hf.arch import Arch
from moezero.checkpoint.hf.families import family_for
from moezero.config import Config, ConfigError, load_config
from moezero.data import Batches, make_corpus
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.model.args import ModelArgs, model_args
from moezero.model.build import build_decoder
from moezero.model.kinds import hf_layer_names
from moezero.model.lora import LoraOptions
from moezero.model.materialize import KeyedInit
from moezero.model.mla import MLA, MLA_KIND
from moezero.model.packing import document_mask
from moezero.plan.store import CheckpointError
from moezero.train import build_model
from tests.support.compare import assert_close_by_fqn
from tests.support.world import run_world
from tests.torch_impl.test_estimate import case
from tests.torch_impl.test_options import MICRO, options_config
from tests.torch_impl.test_recompute import assert_runs_same, runs, with_and_without
from tests.torch_impl.tolerances import RTOL

D, H, S = 48, 3, 13  # S not a power of two
SIZES = {"kv_lora_rank": 12, "qk_nope_head_dim": 10, "qk_rope_head_dim": 6, "v_head_dim": 7}
YARN = {"rope_type": "yarn", "factor": 4.0, "mscale": 0.9, "mscale_all_dim": 0.7,
        "original_max_position_embeddings": 16, "rope_theta": 10000.0}
CASES = {  # name: (q_lora_rank, rope_interleave, attention_bias, YaRN's rope_parameters)
    "q-lora-interleave-bias": (20, True, True, None),
    "q-lora-halves": (20, False, False, None),
    "plain-q-interleave-yarn-scale": (None, True, False, YARN),
    "plain-q-halves-bias": (None, False, True, None),
}


def hf_config(q_rank, interleave, bias, rope=None) -> DeepseekV3Config:
    extra = {} if rope is None else {"rope_parameters": rope}
    cfg = DeepseekV3Config(vocab_size=64, hidden_size=D, num_attention_heads=H,
                           num_key_value_heads=H, q_lora_rank=q_rank, rope_interleave=interleave,
                           attention_bias=bias, n_routed_experts=4, num_experts_per_tok=2,
                           n_group=1, topk_group=1, max_position_embeddings=64, **SIZES,
                           **extra)
    cfg._attn_implementation = "eager"
    return cfg


def randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = 0.3 * torch.randn(p.shape, generator=gen)
            p.copy_(1 + noise if "layernorm" in name else noise)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    """(transformers' attention, moezero's MLA with its weights copied, the HF config)."""
    q_rank, interleave, bias, rope = CASES[request.param]
    cfg = hf_config(q_rank, interleave, bias, rope)
    hf = DeepseekV3Attention(cfg, layer_idx=0).eval()
    randomize(hf, seed=len(request.param))
    mscale = yarn_get_mscale(rope["factor"], rope["mscale_all_dim"]) if rope else 1.0
    args = ModelArgs(dim=D, n_heads=H, attention="mla", q_lora_rank=q_rank,
                     rope_interleave=interleave, attn_bias="all" if bias else "none",
                     mla_mscale=mscale, rope_theta=10000.0, **SIZES)
    mine = MLA(args)
    assert set(mine.state_dict()) == set(hf.state_dict())  # Hugging Face's module names
    mine.load_state_dict(hf.state_dict())
    return hf, mine


def hf_forward(hf: DeepseekV3Attention, x_BSD: torch.Tensor) -> torch.Tensor:
    """transformers' attention on positions 0..S-1 with a causal mask (unscaled RoPE tables:
    the YaRN case checks the softmax factor only)."""
    b, s, _ = x_BSD.shape
    rope_cfg = hf_config(None, True, False)
    cos, sin = DeepseekV3RotaryEmbedding(rope_cfg)(x_BSD, torch.arange(s)[None].expand(b, s))
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    return hf(x_BSD, (cos, sin), mask)[0]


def test_mla_equals_transformers(pair):
    hf, mine = pair
    x = torch.randn(2, S, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (mine(x) - hf_forward(hf, x)).abs().max().item()
    assert diff <= 1e-5, diff


def test_mla_with_a_document_mask_equals_each_document_alone(pair):
    hf, mine = pair
    x = torch.randn(2, S, D, generator=torch.Generator().manual_seed(2))
    docs = torch.tensor([[0] * 5 + [1] * 8, [3] * 2 + [4] * 7 + [5] * 4])
    with torch.no_grad():
        got = mine(x, document_mask(docs))
        for row in range(2):
            for label in docs[row].unique():
                at = (docs[row] == label).nonzero().flatten()
                want = hf_forward(hf, x[row:row + 1, at])
                diff = (got[row:row + 1, at] - want).abs().max().item()
                assert diff <= 1e-5, (row, int(label), diff)


# ----------------------------------------------------------------------- the kind in the model

MODEL = {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 24,
         "attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 6,
         "qk_rope_head_dim": 4, "v_head_dim": 10}
MOE = {"num_experts": 4, "top_k": 2, "ep_size": 1}


def config(**model) -> Config:
    return Config.model_validate({"model": {**MODEL, **model}, "moe": MOE,
                                  "data": {"synthetic_vocab": 32}})


def decoder(cfg: Config, lora: LoraOptions | None = None):
    return build_decoder(model_args(cfg), where="cpu", lora=lora, init=KeyedInit(0))


def test_every_layer_takes_mla_under_attn_with_its_shapes():
    model = decoder(config())
    assert [b.attention_kind.name for b in model.layers] == ["mla", "mla"]
    shapes = {k.removeprefix("layers.1.attn."): tuple(p.shape)
              for k, p in model.named_parameters() if k.startswith("layers.1.attn.")}
    assert shapes == {"q_a_proj.weight": (16, 32), "q_a_layernorm.weight": (16,),
                      "q_b_proj.weight": (2 * 10, 16), "kv_a_proj_with_mqa.weight": (8 + 4, 32),
                      "kv_a_layernorm.weight": (8,), "kv_b_proj.weight": (2 * 16, 8),
                      "o_proj.weight": (32, 2 * 10)}
    plain = decoder(config(q_lora_rank=None, attn_bias="all")).layers[0].attn
    assert plain.q_proj.weight.shape == (20, 32) and plain.q_proj.bias is None
    assert plain.o_proj.bias.shape == (32,) and plain.kv_a_proj_with_mqa.bias.shape == (12,)


def test_hf_names_are_deepseek_v3s_self_attn_keys():
    hf = {*DeepseekV3Attention(hf_config(20, True, True), 0).state_dict(),
          *DeepseekV3Attention(hf_config(None, True, True), 0).state_dict()}
    assert {k.removeprefix("self_attn.") for k in MLA_KIND.hf_names.values()} == hf
    assert all(v == "self_attn." + k.removeprefix("attn.") for k, v in MLA_KIND.hf_names.items())
    assert hf_layer_names("mlp")["attn.kv_b_proj.weight"] == "self_attn.kv_b_proj.weight"


def test_lora_adapts_mla_projections_under_deepseek_v3_module_names():
    """``peft.targets: [attn]`` adapts every projection MLA has; the adapted modules' names
    within a layer are transformers' ``self_attn.*`` modules (what PEFT's target_modules
    match), so a PEFT export names them as deepseek_v3 does."""
    hf_modules = {n for n, m in DeepseekV3Attention(hf_config(20, True, False), 0).named_modules()
                  if isinstance(m, torch.nn.Linear)}
    for q_rank in (16, None):
        model = decoder(config(q_lora_rank=q_rank), LoraOptions(r=2, targets=("attn",)))
        adapted = {k.removeprefix("layers.0.attn.").removesuffix(".lora_A")
                   for k in dict(model.named_parameters()) if k.startswith("layers.0.attn.")
                   and k.endswith("lora_A")}
        q = {"q_a_proj", "q_b_proj"} if q_rank else {"q_proj"}
        assert adapted == q | {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
        names = {hf_layer_names("mlp")[f"attn.{a}.weight"].removesuffix(".weight") for a in adapted}
        assert names == {f"self_attn.{a}" for a in adapted}
        if q_rank:
            assert adapted == hf_modules
    one = decoder(config(), LoraOptions(r=2, targets=("attn.kv_b_proj",)))
    assert {k for k in dict(one.named_parameters()) if "lora" in k} == {
        f"layers.{i}.attn.kv_b_proj.lora_{x}" for i in (0, 1) for x in "AB"}


@pytest.mark.parametrize(("sets", "key"), [
    (["model.qk_norm=head"], "model.qk_norm: must be none with model.attention: mla"),
    (["model.attn_bias=qkv"], "model.attn_bias: must be none or all"),
    (["model.qk_rope_head_dim=5"], "model.qk_rope_head_dim: must be even"),
    (["model.n_kv_heads=2"], "model.n_kv_heads: must be null or 4 with model.attention: mla"),
    (["model.head_dim=16"], "model.head_dim: must be null or 64 with model.attention: mla"),
    (["model.attention=latent"], "model.attention"),
    (["peft.method=lora", "peft.targets=[attn.wq]"], "peft.targets: names attn.wq"),
    (["peft.method=lora", "peft.targets=[attn.q_a_proj]"], "peft.targets: names attn.q_a_proj"),
])
def test_config_refuses_in_one_line(sets, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.attention=mla", "model.kv_lora_rank=8", *sets])
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_mla_takes_transformers_head_dim_and_kv_heads():
    """deepseek_v3's config has ``head_dim`` = ``qk_rope_head_dim`` and
    ``num_key_value_heads`` = ``num_attention_heads``: both are taken (and change nothing)."""
    cfg = load_config(None, ["model.attention=mla", "model.qk_rope_head_dim=8",
                             "model.head_dim=8", "model.n_kv_heads=4"])
    assert cfg.model.head_dim == 8 and cfg.model.n_kv_heads == 4


def test_gqa_refuses_mla_lora_targets():
    with pytest.raises(ConfigError, match="^peft.targets: names attn.o_proj"):
        load_config(None, ["peft.method=lora", "peft.targets=[attn.o_proj]"])


def test_export_of_the_four_families_refuses_mla_in_one_line():
    arch = Arch(64, 32, 2, 2, 24, 1e4, 1e-5, 4, 2, 2, 16, attention="mla")
    with pytest.raises(CheckpointError, match="^model.attention=\"mla\" cannot be exported"):
        family_for(arch)


# ---------------------------------------------------------------------- W = 2 ep 2 vs W = 1

def mla_config(ep: int) -> dict:
    cfg = options_config(ep).model_dump(by_alias=True)
    cfg["model"].update(n_heads=4, n_kv_heads=None, qk_norm="none", attn_bias="all", **{
        k: v for k, v in MODEL.items() if k not in ("vocab_size", "dim", "n_layers", "n_heads",
                                                    "ffn_dim")})
    return cfg


def two_steps_with_losses(cfg_data: dict, stage: int) -> dict:
    """``test_options.two_steps`` on an MLA model, keeping each micro-batch's loss."""
    cfg = Config.model_validate(cfg_data)
    cfg.zero_optimization.stage = stage
    topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    cfg.train.grad_accum_steps = 2 // topo.world_size
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
    batches = Batches(make_corpus(None, vocab=32, sources=2, seed=7), global_batch=2 * MICRO,
                      seq_len=cfg.train.seq_len, seed=3, dp_rank=0, dp_size=1)
    losses = []
    for _ in range(2):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        for batch in slices[topo.rank::topo.world_size]:
            loss, _ = engine.forward(batch)
            engine.backward(loss)
            losses.append(loss.item())
        engine.reduce_gradients()
        engine.optimizer_step()
    params = {k: p.detach().clone().numpy() for k, p in engine.full_parameters().items()}
    return {"losses": losses, "params": params}


@pytest.mark.slow  # ~50 s wall on the shared 2-core box (one 2-rank spawn)
def test_w2_ep2_stage3_equals_w1_with_mla(tmp_path):
    """An MLA model (query latent, biases, sigmoid routing with an expert bias, a gated shared
    expert): W = 2 with ep 2 at ZeRO 3 (one spawn) computes the losses and weights W = 1 does
    at stage 0 (each rank's micro-batch is one of the single run's two)."""
    ranks = run_world(two_steps_with_losses, 2, tmp_path, mla_config(2), 3)
    single = two_steps_with_losses(mla_config(1), 0)
    assert "layers.1.attn.kv_b_proj.weight" in single["params"]
    for step in range(2):
        for rank in range(2):
            mine, want = ranks[rank]["losses"][step], single["losses"][2 * step + rank]
            assert abs(mine - want) <= 1e-6 * abs(want), (step, rank, mine, want)
    params = {k: v for r in ranks for k, v in r["params"].items()}
    assert_close_by_fqn(params, single["params"], RTOL["fp32"])


def test_peft_names_of_mla_adapters_are_the_keys_peft_makes_on_deepseek_v3():
    """The names an adapter export writes (``base_model.model.`` + the Hugging Face key of the
    adapted projection, ``checkpoint/hf/peft_export.py``) are the keys PEFT itself gives a
    deepseek_v3 model's adapters with the same ``target_modules``."""
    from peft import LoraConfig, get_peft_model
    from transformers import DeepseekV3ForCausalLM

    from moezero.checkpoint.hf.family import Family
    from moezero.checkpoint.hf.names import hf_name

    deepseek = Family("deepseek_v3", "DeepseekV3ForCausalLM", "mlp",
                      ("gate_proj", "up_proj", "down_proj"), None, None, None)
    model = decoder(config(), LoraOptions(r=2, targets=("attn",)))
    ours, modules = set(), set()
    for fqn in dict(model.named_parameters()):
        if fqn.endswith(".lora_A") or fqn.endswith(".lora_B"):
            base, ab = fqn.rsplit(".", 1)
            key = hf_name(base + ".weight", deepseek).removesuffix(".weight")
            modules.add(key.split(".", 3)[3])
            ours.add(f"base_model.model.{key}.{ab}.weight")
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
        num_hidden_layers=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=10, intermediate_size=24, moe_intermediate_size=24,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1))
    peft = get_peft_model(hf, LoraConfig(r=2, target_modules=sorted(modules)))
    theirs = {k.replace(".default", "") for k in peft.state_dict() if "lora_" in k}
    assert modules == {"self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                       "self_attn.kv_b_proj", "self_attn.o_proj"}
    assert ours == theirs


def test_activation_checkpointing_is_bit_identical_with_mla():
    """MLA blocks checkpointed (every block, every second block) train bit-identically to no
    checkpointing (W = 1, ZeRO 0)."""
    mla = {k: v for k, v in MODEL.items() if k not in ("vocab_size", "dim", "n_layers",
                                                       "n_heads", "ffn_dim")}
    base = case(0)
    base["model"] = {**base["model"], **mla, "attn_bias": "all"}
    assert_runs_same(runs(with_and_without([base])))
