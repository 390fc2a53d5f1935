"""LoRA checkpoints out to Hugging Face (docs/finetune.md, "Export"), against PEFT and
transformers themselves, no downloads: for each family a tiny random model is imported, LoRA
trained through the CLI (attention, the shared expert where there is one, the routed experts),
exported with ``--format peft`` and loaded by ``PeftModel.from_pretrained`` on the
``--format hf`` export of the base with no missing or unexpected keys (every adapter of rank r
but the fused gate_up one, 2r through ``rank_pattern``), and with ``--merge-lora --format hf``
loaded by ``from_pretrained``: both give moezero's logits within 1e-5 (fp32). Then the
refusals, one line each. Training runs in a subprocess (a launcher and its rank); import and
exports run in this process (``main``), and the runs are shared: about 55 s in all.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moezero.cli import main
from moezero.plan import store
from tests.support.lora import lora_logits
from tests.torch_impl.test_cli import moezero
from tests.torch_impl.test_hf_families import (
    TOKENS,
    assert_logits_close,
    hf_class,
    hf_model,
    save_hf,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = {"mixtral": '["attn","experts"]', "qwen2_moe": '["attn","shared","experts"]',
           "qwen3_moe": '["attn.wq","attn.wo","experts"]', "olmoe": '["attn","experts.w1",'
           '"experts.w2"]'}


R, ALPHA = 4, 12.0  # peft.r, peft.alpha
EXPERTS = 4  # of every tiny family (tests/torch_impl/test_hf_families.py)


def cli(*argv: str) -> None:
    """``moezero ARGV`` in this process (import-hf, checkpoint export)."""
    assert main(list(argv)) == 0, argv


def lora_run(tmp_path: Path, family: str, *sets: str) -> tuple[Path, Path]:
    """(base step dir, adapter step dir) of 3 LoRA steps on an imported tiny model."""
    save_hf(hf_model(family), tmp_path / "hf")
    cli("import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "base"))
    res = moezero("train", "--nproc", "1", "--config", str(tmp_path / "base" / "config.yaml"),
                  "--set", "moe.ep_size=1", "--set", "peft.method=lora",
                  "--set", f"peft.r={R}", "--set", f"peft.alpha={ALPHA}",
                  "--set", f"peft.targets={TARGETS[family]}", "--set", "train.steps=3",
                  "--set", "train.seq_len=12", "--set", "train.micro_batch_size=2",
                  "--set", "optimizer.lr=3e-2", "--out", str(tmp_path / "run"), *sets, timeout=300)
    assert res.returncode == 0, res.stderr
    return (store.find_checkpoint(tmp_path / "base"),
            store.find_checkpoint(tmp_path / "run" / "checkpoints"))


def export(*args: str) -> None:
    cli("checkpoint", "export", *args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(family)``: that family's ``lora_run``, made once for the module."""
    made: dict[str, tuple[Path, Path]] = {}

    def run(family: str) -> tuple[Path, Path]:
        if family not in made:
            made[family] = lora_run(tmp_path_factory.mktemp(family), family)
        return made[family]
    return run


def assert_ranks(folder: Path) -> None:
    """Rank r (the trained one, in the file and the config) for every adapter but the fused
    gate_up one (2r per expert, ``rank_pattern``); the scale alpha/r for all. Every family
    here targets both fused expert parameters, so PEFT nests gate_up as ``experts.base_layer``."""
    config = json.loads((folder / "adapter_config.json").read_text())
    ranks = {k: v.shape[0] for k, v in load_file(folder / "adapter_model.safetensors").items()
             if k.endswith("lora_A.weight")}
    gate_up = {k for k in ranks if ".mlp.experts.base_layer." in k}
    down = {k for k in ranks if ".mlp.experts.lora_A." in k}
    others = ranks.keys() - gate_up - down
    assert gate_up and down and others, sorted(ranks)
    assert {ranks[k] for k in others} == {R}, ranks
    assert {ranks[k] for k in down} == {EXPERTS * R}
    assert {ranks[k] for k in gate_up} == {EXPERTS * 2 * R}
    pattern = r"mlp\.experts\.gate_up_proj"
    assert (config["r"], config["lora_alpha"]) == (R, ALPHA)
    assert config["rank_pattern"] == {pattern: 2 * R}
    assert config["alpha_pattern"] == {pattern: 2 * ALPHA}


@pytest.mark.parametrize("family", list(TARGETS))
def test_peft_adapters_and_merged_weights_give_moezeros_logits(tmp_path, family, runs, capsys):
    import warnings

    from moezero.cli_checkpoint import PEFT_NOTE

    base, adapters = runs(family)
    ours = lora_logits(base, adapters, TOKENS)
    export(str(base), "--format", "hf", "--out", str(tmp_path / "hf_base"))
    capsys.readouterr()
    export(str(adapters), "--format", "peft", "--out", str(tmp_path / "peft"))
    assert capsys.readouterr().out.splitlines()[0] == PEFT_NOTE  # issue 39: said, once
    hf_base = hf_class(family).from_pretrained(tmp_path / "hf_base").eval()
    with torch.no_grad():
        moved = (hf_base(TOKENS).logits - ours).abs().max().item()
    assert moved > 1e-3, f"{family}: the adapters changed the logits by only {moved:.2e}"

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(hf_base, tmp_path / "peft").eval()
    told = [str(w.message) for w in caught if "did not match any targeted module" in str(w.message)]
    assert told and all(r"mlp\\.experts\\.gate_up_proj" in m for m in told), told  # the note's
    saved = set(json.loads((tmp_path / "peft" / "adapter_config.json").read_text()))
    assert {"target_modules", "target_parameters", "r", "lora_alpha"} <= saved
    assert_ranks(tmp_path / "peft")
    ours_keys = set(load_file(tmp_path / "peft" / "adapter_model.safetensors"))
    theirs = {k.replace(".default", "") for k in model.state_dict() if ".lora_" in k}
    assert ours_keys == theirs, (ours_keys ^ theirs)
    with torch.no_grad():
        assert_logits_close(model(TOKENS).logits, ours, f"{family} peft")

    export(str(adapters), "--merge-lora", "--format", "hf", "--out", str(tmp_path / "merged"))
    merged, info = hf_class(family).from_pretrained(tmp_path / "merged",
                                                    output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        assert_logits_close(merged.eval()(TOKENS).logits, ours, f"{family} merged")


def test_other_trained_params_are_merged_and_refused_as_peft(tmp_path, capsys):
    """``train.freeze: ["!*norm.weight"]`` trains the norm gains too: the merge takes them
    from the adapter checkpoint; a PEFT adapter cannot hold them (one line)."""
    base, adapters = lora_run(tmp_path, "olmoe", "--set", 'train.freeze=["!*norm.weight"]')
    ours = lora_logits(base, adapters, TOKENS)
    line = one_line(capsys, str(adapters), "--format", "peft", "--out", str(tmp_path / "o"))
    assert "besides the LoRA adapters" in line and "norm.weight" in line
    assert not (tmp_path / "o").exists()
    export(str(adapters), "--merge-lora", "--format", "hf", "--out", str(tmp_path / "merged"))
    merged = hf_class("olmoe").from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert_logits_close(merged(TOKENS).logits, ours, "olmoe merged with trained norms")


@pytest.fixture(scope="module")
def mixtral_run(runs):
    return runs("mixtral")


def one_line(capsys, *argv: str) -> str:
    code = main(["checkpoint", "export", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("moezero: error: "), (code, err)
    return err[0]


def test_peft_of_a_checkpoint_without_adapters_is_one_line(mixtral_run, tmp_path, capsys):
    base, _ = mixtral_run
    line = one_line(capsys, str(base), "--format", "peft", "--out", str(tmp_path / "o"))
    assert f"{base}: holds no LoRA adapters" in line
    assert not (tmp_path / "o").exists()


def test_merge_lora_needs_format_hf(mixtral_run, tmp_path, capsys):
    _, adapters = mixtral_run
    for fmt in ("moezero", "peft"):
        line = one_line(capsys, str(adapters), "--merge-lora", "--format", fmt,
                        "--out", str(tmp_path / "o"))
        assert "--merge-lora writes Hugging Face weights: it needs --format hf" in line
    assert not (tmp_path / "o").exists()


def test_unmerged_hf_export_of_adapters_is_one_line(mixtral_run, tmp_path, capsys):
    _, adapters = mixtral_run
    line = one_line(capsys, str(adapters), "--format", "hf", "--out", str(tmp_path / "o"))
    assert "holds LoRA adapters" in line and "--merge-lora" in line
    assert not (tmp_path / "o").exists()


def test_a_changed_base_is_refused_in_one_line(mixtral_run, tmp_path, capsys):
    base, adapters = mixtral_run
    manifest = base / "manifest.json"
    original = manifest.read_bytes()
    manifest.write_bytes(original + b" ")
    try:
        for argv in (("--format", "peft"), ("--merge-lora", "--format", "hf")):
            line = one_line(capsys, str(adapters), *argv, "--out", str(tmp_path / "o"))
            assert f"its base checkpoint {base.resolve()} changed since the save" in line
    finally:
        manifest.write_bytes(original)
    assert not (tmp_path / "o").exists()


def _flip_data_byte(step: Path) -> tuple[Path, bytes, str]:
    """One byte of the first model file's tensor data flipped: (path, original bytes, name)."""
    f = store.read_manifest(step).layout.files[0]
    path = step / f.name
    original = path.read_bytes()
    data = bytearray(original)
    data[f.data_start + 3] ^= 0x10
    path.write_bytes(bytes(data))
    return path, original, f.name


@pytest.mark.parametrize("which,argv", [("base", ("--merge-lora", "--format", "hf")),
                                        ("adapters", ("--merge-lora", "--format", "hf")),
                                        ("adapters", ("--format", "peft"))])
def test_export_of_a_changed_byte_is_one_line(mixtral_run, tmp_path, capsys, which, argv):
    """issue 38 #4: export verifies the stored checksums of the base and the adapters as a
    load does; a non-empty --out is refused."""
    base, adapters = mixtral_run
    path, original, name = _flip_data_byte(base if which == "base" else adapters)
    try:
        line = one_line(capsys, str(adapters), *argv, "--out", str(tmp_path / "o"))
    finally:
        path.write_bytes(original)
    assert f"{name} bytes [" in line and "crc32" in line, line
    assert not (tmp_path / "o").exists()
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("x")
    line = one_line(capsys, str(adapters), *argv, "--out", str(tmp_path / "o"))
    assert "exists and is not an empty directory" in line


@pytest.mark.parametrize("argv,made", [(("--format", "peft"), "adapter_model.safetensors"),
                                       (("--merge-lora", "--format", "hf"), "model.safetensors")])
def test_export_base_takes_a_moved_base_and_refuses_another(mixtral_run, tmp_path, capsys,
                                                            argv, made):
    """issue 38 #13: a LoRA run and its base moved together: ``--base PATH`` (the step
    directory or its root) exports what the unmoved run exported; another checkpoint as the
    base, or ``--base`` where no base is read, is one line."""
    base, adapters = mixtral_run
    export(str(adapters), *argv, "--out", str(tmp_path / "before"))
    moved = tmp_path / "moved"
    shutil.copytree(base.parent, moved / "base")
    shutil.copytree(adapters.parent, moved / "run")
    new_adapters = moved / "run" / adapters.name
    parked = base.with_name(base.name + ".moved")
    base.rename(parked)  # the recorded path is gone
    try:
        line = one_line(capsys, str(new_adapters), *argv, "--out", str(tmp_path / "o"))
        assert f"its base checkpoint {base.resolve()} cannot be read" in line, line
        assert "--base PATH" in line, line
        for where in (moved / "base" / base.name, moved / "base"):
            out = tmp_path / f"after-{where.name}"
            export(str(new_adapters), *argv, "--base", str(where), "--out", str(out))
            got, want = load_file(out / made), load_file(tmp_path / "before" / made)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)
            config = "adapter_config.json" if "peft" in argv else "config.json"
            assert (out / config).read_text() == (tmp_path / "before" / config).read_text()
        line = one_line(capsys, str(new_adapters), *argv, "--base", str(new_adapters),
                        "--out", str(tmp_path / "o"))
        assert (f"--base {new_adapters}: not the base of {new_adapters} (manifest sha256 "
                in line and "the LoRA run's base" in line), line
    finally:
        parked.rename(base)
    assert not (tmp_path / "o").exists()
    for fmt in (("--format", "hf"), ("--format", "moezero")):
        line = one_line(capsys, str(base), *fmt, "--base", str(base),
                        "--out", str(tmp_path / "o"))
        assert "--base is read by --format peft and --merge-lora" in line, line
