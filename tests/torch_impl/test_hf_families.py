"""The Hugging Face MoE families (docs/hf.md) against ``transformers`` itself, no downloads:
for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE a tiny random model built from its config is
imported (logits within 1e-5 of transformers, fp32), fine-tuned 5 steps at W = 2, ep 2, ZeRO
stage 2 through the CLI, exported with ``--format hf`` and loaded by ``from_pretrained`` with
no missing or unexpected keys, its logits within 1e-5 of moezero's, every tensor's shape (the
grouped-query K/V included) as the source had it. Then each family's unsupported fields and
the architectures no family holds are refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moezero.checkpoint.hf import export_hf, import_hf
from moezero.checkpoint.hf import families as hf_families
from moezero.cli import main
from moezero.config import Config
from moezero.model.build import config_decoder
from moezero.plan import store
from tests.support.hf import save_hf
from tests.torch_impl.test_cli import moezero

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

ATOL = 1e-5  # the bound on logits, fp32
VOCAB = 128
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rms_norm_eps=1e-6)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=40, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40, num_experts=4, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                       head_dim=12, norm_topk_prob=True, tie_word_embeddings=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=48, num_experts=4, norm_topk_prob=False,
                   pad_token_id=1, eos_token_id=2)),
}


def hf_class(family: str):
    return getattr(transformers, FAMILIES[family][1])


def hf_model(family: str, **overrides):
    """A tiny random model of the family, every tensor random (gains 1 ± 0.1, biases and
    weights N(0, 0.1²)), so each one of them shows in the logits."""
    config_cls, _, own = FAMILIES[family]
    cfg = getattr(transformers, config_cls)(**{**BASE, **own, **overrides})
    torch.manual_seed(0)
    model = hf_class(family)(cfg).eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def moezero_logits(ckpt: Path) -> torch.Tensor:
    """Our decoder (all experts local, dropless) with the checkpoint's masters and buffers."""
    manifest = store.read_manifest(store.find_checkpoint(ckpt))
    cfg = Config.model_validate(manifest.config)
    cfg.moe.ep_size = 1
    model = config_decoder(cfg, where="cpu", init=False).eval()
    tensors = store.read_tensors(store.find_checkpoint(ckpt), manifest)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
    with torch.no_grad():
        return model(TOKENS)[0]


def assert_logits_close(ours, theirs, what: str) -> None:
    diff = (ours - theirs).abs().max().item()
    print(f"{what}: logits max abs diff {diff:.3e} (max |logit| {theirs.abs().max():.3f})")
    assert diff <= ATOL, f"{what}: logits differ by {diff:.3e} > {ATOL:.0e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_import_finetune_w2_ep2_stage2_export(tmp_path, family, capsys):
    """import-hf and export run in this process (``main``; a subprocess each cost a Python and
    torch start-up per family, CI time); the training between them is the CLI's own W = 2."""
    theirs = hf_model(family)
    save_hf(theirs, tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0, \
        capsys.readouterr().err
    assert_logits_close(moezero_logits(tmp_path / "ckpt"), hf_logits(theirs), f"{family} import")

    res = moezero("train", "--nproc", "2", "--set", f"checkpoint.load={tmp_path / 'ckpt'}",
                  "--set", "moe.ep_size=2", "--set", "zero_optimization.stage=2",
                  "--set", "train.steps=5", "--set", "train.seq_len=12",
                  "--set", "train.micro_batch_size=2", "--set", "optimizer.lr=1e-3",
                  "--out", str(tmp_path / "run"), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "step_00000005" in res.stdout, res.stdout
    capsys.readouterr()
    code = main(["checkpoint", "export", str(tmp_path / "run" / "checkpoints"), "--format", "hf",
                 "--out", str(tmp_path / "out")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"as hf-{family} fp32" in out.out, out.out

    back, info = hf_class(family).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert back.config.model_type == family
    assert back.config.num_key_value_heads == 2 < back.config.num_attention_heads
    assert {k: v.shape for k, v in back.state_dict().items()} == {
        k: v.shape for k, v in theirs.state_dict().items()}
    tuned = moezero_logits(tmp_path / "run" / "checkpoints")
    moved = (tuned - hf_logits(theirs)).abs().max().item()
    assert moved > 10 * ATOL, f"{family}: 5 steps changed the logits by only {moved:.2e}"
    assert_logits_close(hf_logits(back.eval()), tuned, f"{family} fine-tuned export")


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_fused_expert_tensors_import_too(tmp_path, family):
    """transformers 5's in-memory form (``mlp.experts.gate_up_proj`` [E, 2F, D])."""
    theirs = hf_model(family)
    import_hf(save_hf(theirs, tmp_path / "hf", fused=True), tmp_path / "ckpt")
    assert_logits_close(moezero_logits(tmp_path / "ckpt"), hf_logits(theirs), f"{family} fused")


# --------------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: save_hf(hf_model(f), root / f) for f in FAMILIES}


BAD = {  # (family, config.json changes, what the one line names)
    "qwen2 sliding window": ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window=true"),
    "qwen3 sliding window": ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=true"),
    "qwen3 dense layers": ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    "qwen2 sparse step": ("qwen2_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    "olmoe clip": ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
    "olmoe head dim": ("olmoe", {"head_dim": 16}, "head_dim=16"),
    "rope scaling": ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                       "rope_theta": 1e4}}, "rope_parameters="),
    "mla": ("qwen2_moe", {"kv_lora_rank": 512}, "kv_lora_rank=512"),
    "other family": ("olmoe", {"model_type": "dbrx"}, 'model_type="dbrx"'),
}


@pytest.mark.parametrize("case", BAD)
def test_unsupported_fields_are_one_line_naming_them(hf_dirs, tmp_path, capsys, case):
    family, changes, expected = BAD[case]
    src = tmp_path / "hf"
    src.mkdir()
    for f in hf_dirs[family].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **changes}))
    code = main(["import-hf", str(src), "--out", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("moezero: error: ") and expected in err[0] and "config.json" in err[0]
    assert not (tmp_path / "ckpt").exists()


def relabel(step: Path, **changes) -> None:
    """Rewrite the architecture keys the manifest's config records (an export reads them)."""
    path = step / "manifest.json"
    manifest = json.loads(path.read_text())
    for key, value in changes.items():
        section, name = key.split(".")
        manifest["config"][section][name] = value
    path.write_text(json.dumps(manifest))


EXPORT_BAD = {  # (source family, manifest config changes, --format, the one line)
    "sigmoid routing": ("qwen3_moe", {"moe.router_scoring": "sigmoid"}, "hf",
                        'moe.router_scoring="sigmoid" cannot be exported as Hugging Face '
                        "qwen3_moe"),
    "expert bias": ("mixtral", {"moe.expert_bias": True}, "hf", "moe.expert_bias=true"),
    "mixtral unnormalised": ("mixtral", {"moe.renormalize": False}, "hf",
                             "moe.renormalize=false cannot be exported as Hugging Face mixtral"),
    "wrong family": ("qwen3_moe", {}, "hf-olmoe", 'model.qk_norm="head" cannot be exported as '
                                                  "Hugging Face olmoe"),
    "ungated shared": ("qwen2_moe", {"moe.shared_gate": False}, "hf", "moe.shared_gate=false"),
}


@pytest.mark.parametrize("case", EXPORT_BAD)
def test_architectures_no_family_holds_are_one_line(hf_dirs, tmp_path, capsys, case):
    family, changes, fmt, expected = EXPORT_BAD[case]
    step = import_hf(hf_dirs[family], tmp_path / "ckpt")
    relabel(step, **changes)
    capsys.readouterr()
    code = main(["checkpoint", "export", str(step), "--format", fmt, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("moezero: error: ") and expected in err[0], err[0]
    assert not (tmp_path / "o" / "config.json").exists()


def test_explicit_family_format_matches_auto(hf_dirs, tmp_path):
    step = import_hf(hf_dirs["olmoe"], tmp_path / "ckpt")
    auto = export_hf(step, tmp_path / "auto")
    named = export_hf(step, tmp_path / "named", model_type="olmoe")
    assert [p.read_bytes() for p in auto] == [p.read_bytes() for p in named]


def test_every_family_holds_only_features_the_refusal_rule_checks():
    """``Family.holds`` names ``families.FEATURES`` fields: a misspelt one would leave its
    feature refused by the family that means to hold it."""
    known = {field for field, _ in hf_families.FEATURES}
    held = set()
    for family in hf_families.FAMILIES.values():
        assert family.holds <= known, (family.model_type, sorted(family.holds - known))
        held |= family.holds
    assert held == known, sorted(known - held)  # every feature is some family's
