"""gpt-oss (issue 36) against ``transformers`` itself, no downloads: a tiny random
``GptOssForCausalLM`` (transformers 5 config: every tensor random, sinks and biases included,
alternating sliding windows of 5 shorter than the 16-token rows, YaRN with a truncated ramp
off) is imported (logits within 1e-5), exported in the hub's layout (every tensor bit-equal,
logits within 1e-5), read from MXFP4 blocks/scales (bit-equal to transformers' own
dequantization), and fine-tuned 10 steps equal to transformers + ``torch.optim.AdamW``; W = 2
ep 2 at stages 0-3 equals W = 1 (slow: one spawn); a PEFT export loads in ``peft`` and a
merged one in transformers (slow: a CLI run); LoRA on the biased, clamped experts runs the
grouped GEMMs as the loop; activation checkpointing is bit-identical (slow); a harmony-format
chat template renders through prepare-data as ``apply_chat_template``; the gpt-oss-20b
recipes' estimate counts transformers' parameters; what gpt-oss cannot hold, and what its
import cannot build, is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from moezero.checkpoint.hf import export_hf, import_hf
from moezero.checkpoint.hf.arch import Arch
from moezero.checkpoint.hf.families import family_for
from moezero.config import Config
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.model.build import config_decoder
from moezero.plan import store
from moezero.plan.store import CheckpointError
from tests.support.compare import assert_close_by_fqn, rel_err
from tests.support.lora import lora_logits
from tests.support.world import run_world
from tests.torch_impl.test_options import each_stage, options_config, two_steps
from tests.torch_impl.tolerances import RTOL

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

ATOL = 1e-5  # the bound on logits, fp32
VOCAB, SEQ, E, F_ = 96, 16, 4, 32
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
HF_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=F_, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=E,
    num_experts_per_tok=2, sliding_window=5, layer_types=LAYER_TYPES,
    max_position_embeddings=256, swiglu_limit=1.5, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 8.0,
                     "original_max_position_embeddings": 16, "beta_fast": 8.0,
                     "beta_slow": 1.0, "truncate": False})
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model():
    """Every tensor random: norm gains 1 + N(0, 0.1²), the rest N(0, 0.2²) (sinks, router
    and expert biases too), so each shows in the logits."""
    cfg = transformers.GptOssConfig(**HF_CONFIG)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(the transformers model, its saved folder, its import)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    model = hf_model()
    model.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "ckpt")
    return model, root / "hf", root / "ckpt"


def hf_logits(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def loaded(ckpt: Path, **changes):
    """(config, our decoder with the checkpoint's tensors, all experts local); ``changes``:
    config sections updated first (the decoder is built from them)."""
    manifest = store.read_manifest(store.find_checkpoint(ckpt))
    data = manifest.config
    for section, values in changes.items():
        data = {**data, section: {**data.get(section, {}), **values}}
    cfg = Config.model_validate(data)
    cfg.moe.ep_size = 1
    model = config_decoder(cfg, where="cpu", init=False)
    tensors = store.read_tensors(store.find_checkpoint(ckpt), manifest)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
    return cfg, model


def moezero_logits(ckpt: Path) -> torch.Tensor:
    model = loaded(ckpt)[1].eval()
    with torch.no_grad():
        return model(TOKENS)[0]


def assert_logits_close(ours, theirs, what: str) -> None:
    diff = (ours - theirs).abs().max().item()
    print(f"{what}: logits max abs diff {diff:.3e} (max |logit| {theirs.abs().max():.3f})")
    assert diff <= ATOL, f"{what}: logits differ by {diff:.3e} > {ATOL:.0e}"


def moezero_names(state: dict) -> dict[str, torch.Tensor]:
    """A transformers gpt-oss state dict in moezero's FQNs, from the hub layout's definition
    (x @ W experts, gate/up interleaved on the last dim)."""
    out = {"embed.weight": state["model.embed_tokens.weight"],
           "norm.weight": state["model.norm.weight"], "lm_head.weight": state["lm_head.weight"]}
    for i in range(len(LAYER_TYPES)):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[q + "attn_norm.weight"] = state[p + "input_layernorm.weight"]
        out[q + "ffn_norm.weight"] = state[p + "post_attention_layernorm.weight"]
        for x in "qkvo":
            for kind in ("weight", "bias"):
                out[f"{q}attn.w{x}.{kind}"] = state[f"{p}self_attn.{x}_proj.{kind}"]
        out[q + "attn.sinks"] = state[p + "self_attn.sinks"]
        for kind in ("weight", "bias"):
            out[f"{q}moe.router.{kind}"] = state[f"{p}mlp.router.{kind}"]
        gate_up, bias = state[p + "mlp.experts.gate_up_proj"], state[p + "mlp.experts.gate_up_proj_bias"]
        for e in range(E):
            x = f"{q}moe.experts.{e}."
            out[x + "w1.weight"], out[x + "w3.weight"] = gate_up[e][:, 0::2].T, gate_up[e][:, 1::2].T
            out[x + "w1.bias"], out[x + "w3.bias"] = bias[e][0::2], bias[e][1::2]
            out[x + "w2.weight"] = state[p + "mlp.experts.down_proj"][e].T
            out[x + "w2.bias"] = state[p + "mlp.experts.down_proj_bias"][e]
    return out


def test_import_then_export_equal_transformers(hub, tmp_path):
    model, _, ckpt = hub
    theirs = hf_logits(model)
    assert_logits_close(moezero_logits(ckpt), theirs, "gpt-oss import")
    cfg = Config.model_validate(store.read_manifest(store.find_checkpoint(ckpt)).config)
    assert cfg.model.layer_types == LAYER_TYPES and cfg.model.rope_type == "yarn"
    assert cfg.moe.router_scoring == "topk_softmax" and cfg.moe.swiglu_limit == 1.5
    export_hf(store.find_checkpoint(ckpt), tmp_path / "out")
    back, info = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "out",
                                                                 output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    written = load_file(tmp_path / "out" / "model.safetensors")
    source = model.state_dict()
    assert written.keys() == source.keys()
    for key, value in source.items():  # the hub's layout, bit for bit
        assert torch.equal(written[key], value), key
    assert back.config.layer_types == LAYER_TYPES and back.config.sliding_window == 5
    assert back.config.rope_parameters == HF_CONFIG["rope_parameters"]
    assert_logits_close(hf_logits(back.float().eval()), theirs, "gpt-oss export")


def quantize(shape: tuple[int, ...], gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 ``(blocks, scales)`` of a [..., R, C] weight: every 4-bit code, and
    scales 2^-7 .. 2^-3 (the format's definition: a biased-127 exponent per 32 elements)."""
    *lead, cols = shape
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 125, (*lead, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_experts_dequantize_bit_equal_to_transformers(hub, tmp_path):
    model, src, _ = hub
    state = load_file(src / "model.safetensors")
    gen, dequantized = torch.Generator().manual_seed(5), {}
    for i in range(len(LAYER_TYPES)):
        for name, shape in (("gate_up_proj", (E, 2 * F_, 32)), ("down_proj", (E, 32, F_))):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks, scales = quantize(shape, gen)
            del state[key]
            state[key + "_blocks"], state[key + "_scales"] = blocks, scales
            dequantized[key] = mxfp4.convert_moe_packed_tensors(blocks, scales,
                                                                 dtype=torch.float32)
    (tmp_path / "hf").mkdir()
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    import_hf(tmp_path / "hf", tmp_path / "ckpt")

    full = {k: v for k, v in model.state_dict().items()}
    full.update(dequantized)
    _, ours = loaded(tmp_path / "ckpt")
    want = moezero_names(full)
    got = dict(ours.named_parameters())
    for fqn in want:
        if ".experts." in fqn:
            assert torch.equal(got[fqn].detach(), want[fqn]), fqn
    model.load_state_dict(full)
    assert_logits_close(ours.eval()(TOKENS)[0].detach(), hf_logits(model), "gpt-oss mxfp4")


def batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen) for _ in range(steps)]


def hf_losses(model, data, opt) -> list[float]:
    losses = []
    model.train()
    for batch in data:
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_ten_steps_equal_transformers_with_torch_adamw(hub):
    model, _, ckpt = hub
    cfg, ours = loaded(ckpt, checkpoint={"load": None}, precision={"dtype": "fp32"},
                       zero_optimization={"stage": 0},
                       moe={"aux_loss_coef": 0.0, "z_loss_coef": 0.0},  # transformers' loss
                       optimizer={"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8,
                                  "weight_decay": 0.01, "no_decay_on_norms": False,
                                  "gradient_clipping": None, "warmup_steps": 0,
                                  "min_lr_ratio": 1.0},
                       train={"steps": 10, "seq_len": SEQ, "micro_batch_size": 2})
    engine = initialize(ours, cfg, topology=build_topology([1], num_experts=E), device="cpu")
    theirs = hf_model()
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.01)
    data = batches(10)
    want = hf_losses(theirs, data, opt)
    got = [engine.train_step([b])["loss"] for b in data]
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    print(f"10 steps: losses {got[0]:.4f} .. {got[-1]:.4f}, max diff {worst:.2e}")
    assert worst <= 1e-6
    assert abs(want[-1] - want[0]) > 1e-3  # it trained
    params = {k: p.detach().numpy() for k, p in engine.full_parameters().items()}
    expected = {k: v.detach().numpy() for k, v in moezero_names(theirs.state_dict()).items()}
    assert_close_by_fqn(params, expected, RTOL["fp32"], "10 steps vs transformers")


def gpt_oss_options(ep: int) -> dict:
    """The options suite's tiny model with every gpt-oss option on."""
    cfg = options_config(ep).model_dump(by_alias=True)
    cfg["model"].update(attn_sinks=True, attn_bias="all", sliding_window=5, qk_norm="none",
                        layer_types=["sliding_attention", "full_attention"], rope_type="yarn",
                        rope_factor=4.0, rope_original_max_positions=8, rope_truncate=False)
    cfg["moe"].update(router_scoring="topk_softmax", router_bias=True, expert_mlp_bias=True,
                      swiglu_limit=1.5, expert_bias=False, shared_ffn_dim=0, shared_gate=False)
    return cfg


@pytest.mark.slow
def test_w2_ep2_stages_0_to_3_equal_w1(tmp_path):
    by_rank = run_world(each_stage, 2, tmp_path, gpt_oss_options(2), (0, 1, 2, 3))
    (single,) = run_world(two_steps, 1, tmp_path, gpt_oss_options(1), 0)
    assert "layers.0.attn.sinks" in single["params"]
    assert "layers.1.moe.experts.3.w2.bias" in single["params"]
    for stage in (0, 1, 2, 3):
        ranks = [r[stage] for r in by_rank]
        for key in ("grads", "params"):
            assert_close_by_fqn({k: v for r in ranks for k, v in r[key].items()}, single[key],
                                RTOL["fp32"])
    assert rel_err(by_rank[0][3]["params"]["layers.0.attn.sinks"],
                   single["params"]["layers.0.attn.sinks"]) <= RTOL["fp32"]


def test_what_other_families_cannot_hold_is_refused_in_one_line(hub):
    _, _, ckpt = hub
    arch = Arch(VOCAB, 32, 3, 4, F_, 1000.0, 1e-5, E, 2, 2, 12, attn_sinks=True)
    with pytest.raises(CheckpointError, match="model.attn_sinks=true cannot be exported as "
                                              "Hugging Face mixtral"):
        family_for(arch, "mixtral")
    with pytest.raises(CheckpointError, match='moe.router_scoring="softmax" cannot be '
                                              "exported as Hugging Face gpt_oss"):
        family_for(Arch(VOCAB, 32, 3, 4, F_, 1000.0, 1e-5, E, 2, 2, 12, attn_sinks=True,
                        router_bias=True), "gpt_oss")
    assert np.isfinite(moezero_logits(ckpt).numpy()).all()


@pytest.mark.slow
def test_peft_export_loads_in_peft_and_merged_in_transformers(hub, tmp_path, capsys):
    """3 LoRA steps (attention) through the CLI on the import: ``--format peft`` loads with
    ``PeftModel.from_pretrained`` on the ``--format hf`` base, ``--merge-lora`` with
    ``from_pretrained``, both within 1e-5 of moezero's logits."""
    peft = pytest.importorskip("peft")
    from moezero.cli import main
    from tests.torch_impl.test_cli import moezero

    _, _, ckpt = hub
    res = moezero("train", "--nproc", "1", "--config", str(ckpt / "config.yaml"),
                  "--set", "moe.ep_size=1", "--set", "peft.method=lora", "--set", "peft.r=4",
                  "--set", "peft.alpha=8", "--set", 'peft.targets=["attn"]',
                  "--set", "train.steps=3", "--set", f"train.seq_len={SEQ}",
                  "--set", "train.micro_batch_size=2", "--set", "optimizer.lr=3e-2",
                  "--out", str(tmp_path / "run"), timeout=300)
    assert res.returncode == 0, res.stderr
    base, adapters = store.find_checkpoint(ckpt), store.find_checkpoint(tmp_path / "run" / "checkpoints")
    ours = lora_logits(base, adapters, TOKENS)
    for args in (("--format", "hf", "--out", str(tmp_path / "hf_base")),):
        assert main(["checkpoint", "export", str(base), *args]) == 0
    assert main(["checkpoint", "export", str(adapters), "--format", "peft",
                 "--out", str(tmp_path / "peft")]) == 0
    hf_base = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "hf_base").eval()
    assert (hf_logits(hf_base) - ours).abs().max() > 1e-3  # the adapters trained
    with_adapters = peft.PeftModel.from_pretrained(hf_base, tmp_path / "peft").eval()
    assert_logits_close(hf_logits(with_adapters), ours, "gpt-oss peft")
    assert main(["checkpoint", "export", str(adapters), "--merge-lora", "--format", "hf",
                 "--out", str(tmp_path / "merged")]) == 0
    merged, info = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "merged",
                                                                  output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert_logits_close(hf_logits(merged.eval()), ours, "gpt-oss merged")


def test_expert_lora_with_biases_and_clamp_grouped_equals_loop():
    """LoRA on gpt-oss experts (biases, clamped SwiGLU): the grouped GEMMs equal the loop over
    experts, forward and every gradient (biases and adapters included)."""
    from moezero.model import model_args
    from moezero.model.build import build_decoder
    from moezero.model.lora import LoraOptions
    from moezero.model.materialize import KeyedInit

    cfg = Config.model_validate(gpt_oss_options(1))
    lora = LoraOptions(r=2, alpha=4.0, targets=("attn", "experts"))
    runs = []
    for grouped in (True, False):
        model = build_decoder(model_args(cfg), where="cpu", lora=lora, init=KeyedInit(0))
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(
                    len(name))))
        for layer in model.layers:
            layer.moe.grouped = grouped
        loss, _ = model.loss(TOKENS[:, :13] % 64)
        loss.backward()
        runs.append((loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    assert abs(runs[0][0] - runs[1][0]) <= 1e-6
    assert_close_by_fqn({k: v.numpy() for k, v in runs[0][1].items()},
                        {k: v.numpy() for k, v in runs[1][1].items()}, RTOL["fp32"])


# gpt-oss's harmony format, in the shape of its hub template (written here, nothing
# downloaded): a system block (identity, cutoff, today's date, reasoning effort, channels),
# developer instructions from a system message, ``<|start|>role<|message|>...<|end|>`` turns,
# the assistant's answer on the final channel, its reasoning (``thinking``) on the analysis
# channel for the last turn only, ``<|return|>`` ending the last turn. The assistant's tokens
# are marked with ``{% generation %}`` (earlier turns render differently once later ones follow,
# so prefixes cannot locate them).
HARMONY = """\
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n' -}}
{{- 'Knowledge cutoff: 2024-06\\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\\n\\n' -}}
{{- 'Reasoning: ' + (reasoning_effort | default('medium')) + '\\n\\n' -}}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' -}}
{%- if messages[0].role == 'system' %}
{{- '<|start|>developer<|message|># Instructions\\n\\n' + messages[0].content + '<|end|>' -}}
{%- set messages = messages[1:] %}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<|start|>user<|message|>' + message.content + '<|end|>' -}}
{%- elif message.role == 'assistant' %}
{{- '<|start|>assistant' -}}
{%- generation %}
{%- if loop.last and message.thinking %}
{{- '<|channel|>analysis<|message|>' + message.thinking + '<|end|><|start|>assistant' -}}
{%- endif %}
{{- '<|channel|>final<|message|>' + message.content + ('<|return|>' if loop.last else '<|end|>') -}}
{%- endgeneration %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' -}}{%- endif %}"""
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>")


def test_harmony_chat_renders_as_apply_chat_template_with_the_assistant_mask(tmp_path):
    from moezero.cli import main
    from moezero.data.indexed import TokenDataset
    from tests.torch_impl.tokenizer_util import save_tokenizer, sentences, train_bpe

    tok = train_bpe(sentences(200) + ["Hello, how are you? I am fine."])
    tok.add_special_tokens(list(HARMONY_TOKENS))
    save_tokenizer(tok, tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").write_text(HARMONY)
    convs = [[{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "the cat sat?"},
              {"role": "assistant", "content": "the dog ran."},
              {"role": "user", "content": "and then?"},
              {"role": "assistant", "content": "a big red fox.", "thinking": "the fox ran."}],
             [{"role": "user", "content": "hello"},
              {"role": "assistant", "content": "Hello, how are you?"}]]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n"
                                                  for c in convs))
    assert main(["prepare-data", str(tmp_path / "chats.jsonl"), "--tokenizer",
                 str(tmp_path / "tok"), "--format", "chat", "--workers", "1",
                 "--out", str(tmp_path / "out")]) == 0
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ds = TokenDataset(tmp_path / "out")
    kept_text = ["<|channel|>final<|message|>the dog ran.<|end|><|channel|>analysis<|message|>"
                 "the fox ran.<|end|><|start|>assistant<|channel|>final<|message|>a big red "
                 "fox.<|return|>", "<|channel|>final<|message|>Hello, how are you?<|return|>"]
    for i, conv in enumerate(convs):
        a, b = int(ds.offsets[i]), int(ds.offsets[i + 1])
        ids, mask = ds.read(a, b).tolist(), ds.mask(a, b).tolist()
        assert ids == hf.apply_chat_template(conv, tokenize=True)["input_ids"]
        kept = hf.decode([t for t, m in zip(ids, mask, strict=True) if m])
        assert kept == kept_text[i]


@pytest.mark.slow
def test_activation_checkpointing_is_bit_identical():
    """Every gpt-oss option on (windows on every layer), stages 0 and 3: checkpointed blocks
    train bit-identically to no checkpointing."""
    from tests.torch_impl.test_estimate import case
    from tests.torch_impl.test_recompute import assert_runs_same, runs, with_and_without

    def gpt_oss(c: dict) -> dict:
        return {**c, "model": {**c["model"], "attn_sinks": True, "attn_bias": "all",
                               "sliding_window": 5, "rope_type": "yarn", "rope_factor": 4.0,
                               "rope_original_max_positions": 8},
                "moe": {**c["moe"], "router_scoring": "topk_softmax", "router_bias": True,
                        "expert_mlp_bias": True, "swiglu_limit": 1.5}}
    assert_runs_same(runs(with_and_without([gpt_oss(case(0)), gpt_oss(case(3))])))


def test_recipes_estimate_count_every_gpt_oss_20b_parameter():
    """The recipes' architecture is gpt-oss-20b's: ``moezero estimate`` counts exactly the
    parameters of transformers' model of that config (built on the meta device), sinks and
    biases included; the LoRA recipe trains only the attention adapters and fits 80 GB."""
    from moezero.config import load_config
    from moezero.estimate import estimate

    with torch.device("meta"):
        hub_model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            num_hidden_layers=24, num_local_experts=32))
    total = sum(p.numel() for p in hub_model.parameters())
    recipes = Path(__file__).resolve().parents[2] / "torch_impl" / "recipes"
    no_base = ["checkpoint.load=null"]
    sft = estimate(load_config(recipes / "gpt-oss-20b-sft.yaml", no_base), 8)
    lora = estimate(load_config(recipes / "gpt-oss-20b-lora.yaml", no_base), 1)
    assert sft.model_numel == total == 20_914_757_184
    adapters = 24 * 16 * ((2880 + 64 * 64) * 2 + (2880 + 8 * 64) * 2)
    assert (lora.model_numel, lora.trained_numel) == (total + adapters, adapters)
    assert max(sft.peak("device"), lora.peak("device")) < 70 * 2**30


BAD_CONFIGS = {  # config.json changes, what the one line names
    "quantization": ({"quantization_config": {"quant_method": "fp8"}},
                     'quantization_config.quant_method="fp8"'),
    "layer types": ({"layer_types": ["full_attention"]}, 'layer_types=["full_attention"]'),
    "rope type": ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
                  "rope_parameters="),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_what_gpt_oss_import_cannot_build_is_one_line(hub, tmp_path, capsys, case):
    from moezero.cli import main

    _, src, _ = hub
    changes, expected = BAD_CONFIGS[case]
    (tmp_path / "hf").mkdir()
    for f in src.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **changes}))
    code = main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "ckpt").exists()
