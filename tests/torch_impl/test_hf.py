"""Hugging Face Mixtral interop (docs/hf.md): ``moezero import-hf`` and ``checkpoint export
--format hf-mixtral`` against ``transformers`` itself (tiny random models, no downloads),
fine-tuning an imported model through the CLI, and one-line errors on what moezero refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from moezero.checkpoint.hf import export_hf, import_hf
from moezero.cli import main
from moezero.config import Config, load_config
from moezero.model.build import config_decoder
from moezero.model.decoder import Decoder
from moezero.plan import plan_groups, plan_layout, store
from moezero.plan.specs import ParamSpec
from moezero.train import setup
from tests.support.hf import save_hf as _save_hf
from tests.torch_impl.test_cli import moezero
from tests.torch_impl.tolerances import RTOL

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

TOL = RTOL["fp32"]
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
             max_position_embeddings=128, rope_theta=5e5, rms_norm_eps=1e-6)
FORMS = {"mha": {"num_key_value_heads": 4}, "gqa_tied": {"num_key_value_heads": 2,
                                                         "tie_word_embeddings": True}}
TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**{**SMALL, **overrides})
    return transformers.MixtralForCausalLM(cfg).eval()


def save_hf(model, path: Path, fused: bool = False) -> Path:
    return _save_hf(model, path, fused, shard="20KB")


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def moezero_model(ckpt: Path) -> Decoder:
    """Our decoder (all experts local, dropless) with the checkpoint's masters."""
    manifest = store.read_manifest(store.find_checkpoint(ckpt))
    cfg = Config.model_validate(manifest.config)
    cfg.moe.ep_size = 1
    model = config_decoder(cfg, where="cpu", init=False).eval()
    tensors = store.read_tensors(store.find_checkpoint(ckpt), manifest)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
    return model


def our_logits(model: Decoder) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)[0]


def assert_logits_equal(ours, theirs, what: str) -> None:
    diff = (ours - theirs).abs().max().item()
    print(f"{what}: logits max abs diff {diff:.3e} (max |logit| {theirs.abs().max():.3f})")
    torch.testing.assert_close(ours, theirs, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert_on_disk", "fused_3d"])
@pytest.mark.parametrize("form", FORMS)
def test_import_matches_transformers_and_exports_back(tmp_path, form, fused):
    theirs = hf_model(**FORMS[form])
    step = import_hf(save_hf(theirs, tmp_path / "hf", fused), tmp_path / "ckpt")
    manifest = store.read_manifest(step)
    assert manifest.layout.weights_only and manifest.step == 0
    assert not any(f.name.startswith("optim") for f in step.iterdir())
    assert store.verify(step) == []
    ours = moezero_model(tmp_path / "ckpt")
    assert_logits_equal(our_logits(ours), hf_logits(theirs), f"import {form} fused={fused}")

    export_hf(step, tmp_path / "out", shard_bytes=20_000)
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    back, info = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    # grouped-query attention kept exact both ways: no K/V expansion anywhere
    assert back.config.num_key_value_heads == theirs.config.num_key_value_heads
    assert {k: v.shape for k, v in back.state_dict().items()} == {
        k: v.shape for k, v in theirs.state_dict().items()}
    assert_logits_equal(hf_logits(back.eval()), hf_logits(theirs), f"export {form}")


def test_bf16_weights_import_exactly_as_fp32_masters(tmp_path):
    theirs = hf_model().to(torch.bfloat16)
    import_hf(save_hf(theirs, tmp_path / "hf"), tmp_path / "ckpt")
    assert_logits_equal(our_logits(moezero_model(tmp_path / "ckpt")), hf_logits(theirs.float()),
                        "import bf16")


def test_imported_checkpoint_has_a_usable_config_yaml(tmp_path):
    import_hf(save_hf(hf_model(), tmp_path / "hf"), tmp_path / "ckpt")
    cfg = load_config(tmp_path / "ckpt" / "config.yaml")
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.ffn_dim, cfg.model.norm_eps) == (
        32, 2, 48, 1e-6)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.model.rope_theta) == (4, 2, 5e5)
    assert cfg.checkpoint.load == str((tmp_path / "ckpt").resolve())
    code = main(["checkpoint", "inspect", str(tmp_path / "ckpt")])
    assert code == 0


def test_weights_only_layout_round_trips_through_the_manifest(tmp_path):
    specs = [ParamSpec("a", (2, 3), "float32", "all"), ParamSpec("b", (5,), "float32", "all")]
    layout = plan_layout(plan_groups(specs, max_group_size=4), {"a": (2, 3), "b": (5,)},
                         step=0, weights_only=True)
    assert layout.weights_only and not layout.optim_files and layout.model_files
    partial = store.begin_save(tmp_path, 0)
    records = store.write_headers(layout, partial)
    values = {"a": np.arange(6, dtype=np.float32), "b": np.arange(5, dtype=np.float32) + 10}
    for f in layout.model_files:
        for t in f.tensors:
            crc = store.write_range(partial / f.name, f.data_start + t.begin,
                                    values[t.fqn][t.start:t.stop])
            records.append((f.name, f.data_start + t.begin, t.end - t.begin, crc))
    store.write_manifest(partial, layout, checksums=records)
    manifest = store.read_manifest(store.commit(partial))
    assert manifest.layout.weights_only
    np.testing.assert_array_equal(store.read_param(tmp_path / "step_00000000", manifest, "a"),
                                  values["a"])
    with pytest.raises(KeyError, match="weights-only"):
        store.read_param(tmp_path / "step_00000000", manifest, "a", state="exp_avg")


@pytest.mark.parametrize("stage", [0, 1])
def test_engine_loads_weights_only_with_fresh_moments(tmp_path, stage):
    """After a step (non-zero moments), loading sets the HF weights, zero moments, step 0."""
    theirs = hf_model(**FORMS["gqa_tied"])
    import_hf(save_hf(theirs, tmp_path / "hf"), tmp_path / "ckpt")
    cfg = load_config(tmp_path / "ckpt" / "config.yaml",
                      ["moe.ep_size=1", f"zero_optimization.stage={stage}", "precision.dtype=fp32"])
    engine, _ = setup(cfg, torch.device("cpu"))
    engine.train_step([torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(2))])
    moments = [t for shard in engine.optimizer.shards() for k, t in shard.tensors.items()
               if k != "master"]
    assert any(t.any() for t in moments) and engine.step_count == 1
    assert engine.load_checkpoint(tmp_path / "ckpt") == {}
    assert (engine.step_count, engine.global_steps) == (0, 0)
    assert not any(t.any() for t in moments)  # the same tensors, zeroed in place
    assert_logits_equal(our_logits(engine.model.eval()), hf_logits(theirs), f"engine stage {stage}")


def test_finetune_imported_model_w2_ep2_stage2_then_export(tmp_path, capsys):
    """import-hf -> train at W=2, ep=2, ZeRO-2 (architecture adopted) -> export -> transformers.
    import-hf and export run in this process (``main``: a subprocess each cost a Python and
    torch start-up, CI time); the training is the CLI's own W = 2."""
    theirs = hf_model(**FORMS["gqa_tied"])
    save_hf(theirs, tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0, \
        capsys.readouterr().err
    res = moezero("train", "--nproc", "2", "--set", f"checkpoint.load={tmp_path / 'ckpt'}",
                  "--set", "moe.ep_size=2", "--set", "zero_optimization.stage=2",
                  "--set", "train.steps=3", "--set", "train.seq_len=12",
                  "--set", "train.micro_batch_size=2", "--set", "optimizer.lr=1e-4",
                  "--out", str(tmp_path / "run"), timeout=240)
    assert res.returncode == 0, res.stderr
    assert "moezero: architecture from checkpoint" in res.stdout and "model.dim=32" in res.stdout
    assert "step_00000003" in res.stdout
    # issue 39: a fine-tune starts from its base; it does not resume "at step 0"
    assert f"moezero: starting from base {tmp_path / 'ckpt' / 'step_00000000'} " in res.stdout
    assert "resumed from" not in res.stdout
    capsys.readouterr()
    code = main(["checkpoint", "export", str(tmp_path / "run" / "checkpoints"), "--format",
                 "hf-mixtral", "--out", str(tmp_path / "out")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.startswith("exported step_00000003 as hf-mixtral fp32: "), out.out
    assert out.out.count("step_00000003") == 1, out.out  # the step named once
    tuned = moezero_model(tmp_path / "run" / "checkpoints")
    imported = moezero_model(tmp_path / "ckpt")
    moved = max((a - b).abs().max().item() for a, b in
                zip(tuned.state_dict().values(), imported.state_dict().values(), strict=True))
    assert 0 < moved < 1e-2, moved  # trained from the imported weights, a few small steps
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_logits_equal(hf_logits(back), our_logits(tuned), "fine-tuned export")


def test_an_explicit_mismatching_architecture_is_one_line(tmp_path, capsys):
    import_hf(save_hf(hf_model(), tmp_path / "hf"), tmp_path / "ckpt")
    capsys.readouterr()
    code = main(["train", "--set", f"checkpoint.load={tmp_path / 'ckpt'}", "--set",
                 "model.ffn_dim=64", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("moezero: error: model.ffn_dim: 64 differs from the checkpoint's 48")


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


BAD = {
    "model_type": ({"model_type": "llama"}, 'model_type="llama"'),
    "sliding_window": ({"sliding_window": 16}, "sliding_window=16"),
    "rope_scaling": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 1e4}}, "rope_parameters="),
    "hidden_act": ({"hidden_act": "gelu"}, 'hidden_act="gelu"'),
    "head_dim": ({"head_dim": 7}, "head_dim=7"),
    "kv_heads": ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_hf(hf_model(), tmp_path_factory.mktemp("hf") / "hf")


@pytest.mark.parametrize("case", BAD)
def test_unsupported_config_is_one_line_naming_key_and_value(hf_dir, tmp_path, capsys, case):
    changes, expected = BAD[case]
    src = tmp_path / "hf"
    src.mkdir()
    for f in hf_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    _edit_config(src, **changes)
    code = main(["import-hf", str(src), "--out", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("moezero: error: ") and expected in err[0] and "config.json" in err[0]
    assert not (tmp_path / "ckpt").exists()


def test_missing_inputs_are_one_line(hf_dir, tmp_path, capsys):
    cases = [(tmp_path / "nowhere", "no such directory"),
             (tmp_path, "no config.json")]
    (tmp_path / "bias").mkdir()
    for f in hf_dir.iterdir():
        (tmp_path / "bias" / f.name).write_bytes(f.read_bytes())
    save_file({"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)},
              tmp_path / "bias" / "extra.safetensors")
    index = json.loads((tmp_path / "bias" / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = "extra.safetensors"
    (tmp_path / "bias" / "model.safetensors.index.json").write_text(json.dumps(index))
    cases.append((tmp_path / "bias", "q_proj.bias has no place"))
    for src, expected in cases:
        code = main(["import-hf", str(src), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("moezero: error: "), err
        assert expected in err[0], err[0]


def test_import_refuses_a_non_empty_out(hf_dir, tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "keep.txt").write_text("x")
    code = main(["import-hf", str(hf_dir), "--out", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 2 and "not an empty directory" in err


def test_estimate_adopts_the_architecture_of_checkpoint_load(tmp_path, capsys):
    """``moezero estimate --set checkpoint.load=...`` sizes the imported model, as ``train``
    would build it (before: the default recipe's model, whatever the checkpoint held)."""
    theirs = hf_model()
    import_hf(save_hf(theirs, tmp_path / "hf"), tmp_path / "ckpt")
    capsys.readouterr()
    code = main(["estimate", "--nproc", "2", "--device", "cpu", "--set", "moe.ep_size=1",
                 "--set", f"checkpoint.load={tmp_path / 'ckpt'}"])
    out = capsys.readouterr().out
    assert code == 0 and "moezero: architecture from checkpoint" in out
    numel = sum(p.numel() for p in moezero_model(tmp_path / "ckpt").parameters())
    assert f"model {numel:,} params" in out


def _one_line(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("moezero: error: "), (code, err)
    return err[0]


@pytest.mark.parametrize("fmt", ["moezero", "hf"])
def test_export_verifies_checksums_and_refuses_a_non_empty_out(hf_dir, tmp_path, capsys, fmt):
    """issue 38 #4: one changed byte of embed_tokens is refused as a load refuses it (one line
    naming the file and range, exit 2, no --out left); a non-empty --out is refused and kept."""
    step = import_hf(hf_dir, tmp_path / "ckpt")
    manifest = store.read_manifest(step)
    f = next(f for f in manifest.layout.files if any(
        t.fqn == "embed.weight" and t.state == "master" for t in f.tensors))
    data = bytearray((step / f.name).read_bytes())
    data[f.data_start + 5] ^= 0x40
    (step / f.name).write_bytes(bytes(data))
    line = _one_line(capsys, "checkpoint", "export", step, "--format", fmt,
                     "--out", tmp_path / "out")
    assert f"{f.name} bytes [" in line and "crc32" in line, line
    assert not (tmp_path / "out").exists()

    data[f.data_start + 5] ^= 0x40
    (step / f.name).write_bytes(bytes(data))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    line = _one_line(capsys, "checkpoint", "export", step, "--format", fmt,
                     "--out", tmp_path / "full")
    assert f"--out {tmp_path / 'full'}: exists and is not an empty directory" in line, line
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    assert main(["checkpoint", "export", str(step), "--format", fmt,
                 "--out", str(tmp_path / "out")]) == 0
