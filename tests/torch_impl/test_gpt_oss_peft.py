"""gpt-oss routed-expert LoRA out to PEFT (issue 36), against ``peft`` and ``transformers``
themselves, no downloads: the tiny random gpt-oss of ``test_gpt_oss`` is imported, LoRA
trained in this process on attention and the routed experts (w1, w2, w3), and exported
``--format peft`` beside ``--format hf`` of its base: ``PeftModel.from_pretrained`` loads it
with exactly the file's keys (no missing or unexpected ones), the fused expert adapters ranked
as the config says, and gives the logits of the ``--merge-lora`` export and of moezero within
1e-5 (fp32). transformers' gpt-oss experts are x @ W with gate and up interleaved on the last
dim, which PEFT adapts as [experts, in, out] (``is_transposed``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moezero.checkpoint.hf import import_hf
from moezero.cli import main
from moezero.config import Config
from moezero.plan import store
from moezero.plan.reading import read_tensors
from moezero.train import train
from tests.support.lora import lora_logits
from tests.torch_impl.test_gpt_oss import SEQ, TOKENS, assert_logits_close, hf_logits, hf_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

R, ALPHA, E = 4, 12.0, 4  # peft.r, peft.alpha, the tiny model's experts


def export(*argv: str) -> None:
    assert main(["checkpoint", "export", *argv]) == 0, argv


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(base step dir, adapter step dir, folder): 3 LoRA steps on attention and every routed
    expert projection of the imported tiny gpt-oss, then the three exports."""
    root = tmp_path_factory.mktemp("gpt_oss_peft")
    hf_model().save_pretrained(root / "hf")
    import_hf(root / "hf", root / "ckpt")
    base = store.find_checkpoint(root / "ckpt")
    cfg = Config.model_validate(store.read_manifest(base).config)
    cfg.moe.ep_size = 1
    cfg.peft = cfg.peft.model_copy(update={"method": "lora", "r": R, "alpha": ALPHA,
                                           "targets": ["attn", "experts"]})
    cfg.train = cfg.train.model_copy(update={"steps": 3, "seq_len": SEQ, "micro_batch_size": 2,
                                             "eval_every": 0, "log_every": 100})
    cfg.optimizer.lr, cfg.checkpoint.every = 3e-2, 0
    train(Config.model_validate(cfg.model_dump(by_alias=True)), str(root / "run"))
    adapters = store.find_checkpoint(root / "run" / "checkpoints")
    export(str(base), "--format", "hf", "--out", str(root / "hf_base"))
    export(str(adapters), "--format", "peft", "--out", str(root / "peft"))
    export(str(adapters), "--merge-lora", "--format", "hf", "--out", str(root / "merged"))
    return base, adapters, root


def peft_model(root: Path):
    base = transformers.GptOssForCausalLM.from_pretrained(root / "hf_base").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rank_pattern note (cli_checkpoint.PEFT_NOTE)
        return peft.PeftModel.from_pretrained(base, root / "peft").eval()


def test_expert_adapters_load_in_peft_with_the_merged_exports_logits(run):
    base, adapters, root = run
    model = peft_model(root)
    saved = load_file(root / "peft" / "adapter_model.safetensors")
    theirs = {k.replace(".default", "") for k in model.state_dict() if ".lora_" in k}
    assert set(saved) == theirs, set(saved) ^ theirs  # no missing, no unexpected keys
    gate_up = [k for k in saved if ".mlp.experts.base_layer.lora_B" in k]
    assert gate_up and all(saved[k].shape == (2 * 32, E * 2 * R) for k in gate_up)
    assert min(saved[k].abs().max().item() for k in gate_up) > 1e-3  # the experts trained
    config = json.loads((root / "peft" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    merged, info = transformers.GptOssForCausalLM.from_pretrained(root / "merged",
                                                                  output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    want = hf_logits(merged.eval())
    plain = hf_logits(transformers.GptOssForCausalLM.from_pretrained(root / "hf_base").eval())
    assert (plain - want).abs().max() > 1e-3  # the adapters change the logits
    assert_logits_close(hf_logits(model), want, "gpt-oss expert LoRA: peft vs --merge-lora")
    assert_logits_close(lora_logits(base, adapters, TOKENS), want,
                        "gpt-oss expert LoRA: moezero vs --merge-lora")


def test_expert_adapters_alone_carry_the_experts_update(run):
    """Only the routed-expert adapters of the PEFT export (attention's zeroed) equal the merge
    of only those: the interleaved gate/up rows and the x @ W orientation are right on their
    own, not hidden by the attention adapters."""
    base, adapters, root = run
    model = peft_model(root)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".self_attn." in name and ".lora_B." in name:
                p.zero_()
    hf_base = transformers.GptOssForCausalLM.from_pretrained(root / "hf_base").eval()
    scale = ALPHA / R
    trained = read_tensors(adapters, store.read_manifest(adapters))
    with torch.no_grad():
        for layer, block in enumerate(hf_base.model.layers):
            experts = block.mlp.experts
            for e in range(E):
                q = f"layers.{layer}.moe.experts.{e}."
                delta = {w: scale * torch.from_numpy(trained[f"{q}{w}.lora_B"])
                         @ torch.from_numpy(trained[f"{q}{w}.lora_A"]) for w in ("w1", "w2", "w3")}
                experts.gate_up_proj[e][:, 0::2] += delta["w1"].T
                experts.gate_up_proj[e][:, 1::2] += delta["w3"].T
                experts.down_proj[e] += delta["w2"].T
    assert_logits_close(hf_logits(model), hf_logits(hf_base), "gpt-oss experts-only peft")
