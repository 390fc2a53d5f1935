"""Qwen3-Next fine-tuning through the CLI (docs/finetune.md): LoRA on the gated DeltaNet
(``linear_attn``), the gated attention and the routed experts of an imported tiny model,
exported with ``--format peft`` and loaded by ``PeftModel.from_pretrained`` on the
``--format hf`` export of the base (no missing or unexpected adapter keys), and merged with
``--merge-lora``: both give moezero's logits within 1e-5 (fp32). Shared-expert adapters export
merged; as PEFT they are refused in one line (PEFT would drop them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moezero.cli import main
from tests.support.hf import save_hf
from tests.support.lora import lora_logits
from tests.torch_impl.test_cli import moezero
from tests.torch_impl.test_peft_export import cli, export
from tests.torch_impl.test_qwen3_next import TOKENS, hf_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = 1e-5
TARGETS = '["attn","linear_attn","experts"]'


def lora_run(tmp_path: Path, targets: str, steps: int) -> tuple[Path, Path]:
    """(base, adapters): ``steps`` LoRA steps on ``targets`` of an imported tiny model."""
    if not (tmp_path / "base").exists():
        save_hf(hf_model("linear-ends"), tmp_path / "hf")
        cli("import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "base"))
    run = tmp_path / f"run{steps}"
    res = moezero("train", "--nproc", "1", "--config", str(tmp_path / "base" / "config.yaml"),
                  "--set", "moe.ep_size=1", "--set", "peft.method=lora", "--set", "peft.r=4",
                  "--set", "peft.alpha=12", "--set", f"peft.targets={targets}",
                  "--set", "model.gated_delta_chunk=4", "--set", f"train.steps={steps}",
                  "--set", "train.seq_len=13", "--set", "train.micro_batch_size=2",
                  "--set", "optimizer.lr=3e-2", "--out", str(run), timeout=300)
    assert res.returncode == 0, res.stderr
    return tmp_path / "base" / "step_00000000", run / "checkpoints" / f"step_{steps:08d}"


def test_lora_peft_and_merged_exports_give_moezeros_logits(tmp_path, capsys):
    base, adapters = lora_run(tmp_path, TARGETS, 3)
    ours = lora_logits(base, adapters, TOKENS)
    export(str(base), "--format", "hf", "--out", str(tmp_path / "hf_base"))
    export(str(adapters), "--format", "peft", "--out", str(tmp_path / "peft"))
    hf_base = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "hf_base").eval()
    with torch.no_grad():
        moved = (hf_base(TOKENS).logits - ours).abs().max().item()
    assert moved > 1e-3, f"the adapters changed the logits by only {moved:.2e}"
    model = peft.PeftModel.from_pretrained(hf_base, tmp_path / "peft").eval()
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {"linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj",
            "self_attn.q_proj"} <= set(config["target_modules"])
    ours_keys = set(load_file(tmp_path / "peft" / "adapter_model.safetensors"))
    theirs = {k.replace(".default", "") for k in model.state_dict() if ".lora_" in k}
    assert ours_keys == theirs, ours_keys ^ theirs
    with torch.no_grad():
        diff = (model(TOKENS).logits - ours).abs().max().item()
    print(f"peft: logits max abs diff {diff:.3e}")
    assert diff <= TOL

    export(str(adapters), "--merge-lora", "--format", "hf", "--out", str(tmp_path / "merged"))
    merged, info = transformers.Qwen3NextForCausalLM.from_pretrained(
        tmp_path / "merged", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        diff = (merged.eval()(TOKENS).logits - ours).abs().max().item()
    print(f"merged: logits max abs diff {diff:.3e}")
    assert diff <= TOL

    # the shared expert's adapters: merged exactly; as PEFT refused in one line, since PEFT's
    # qwen3_next conversion reads every *.gate_proj/up_proj/down_proj target as the experts'
    base, adapters = lora_run(tmp_path, '["shared"]', 1)
    capsys.readouterr()
    assert main(["checkpoint", "export", str(adapters), "--format", "peft",
                 "--out", str(tmp_path / "shared_peft")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "shared expert" in err[0] and "--merge-lora" in err[0], err
    ours = lora_logits(base, adapters, TOKENS)
    export(str(adapters), "--merge-lora", "--format", "hf", "--out", str(tmp_path / "merged2"))
    merged = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "merged2").eval()
    with torch.no_grad():
        assert (merged(TOKENS).logits - ours).abs().max().item() <= TOL
