"""A resume (``checkpoint.load``) keeps the checkpoint's architecture (torch_impl/train.py:
adopt_architecture): keys the run leaves unset are adopted; a key set to another value is
refused in one line naming it and both values, shape-changing or not, unless
``checkpoint.allow_arch_change`` lists it. Checked through ``moezero estimate`` (the same
adoption, no ranks) and ``moezero train``."""

from __future__ import annotations

import pytest

from moezero.cli import main
from moezero.config import ARCHITECTURE_KEYS
from moezero.plan import store
from tests.torch_impl.test_hf import hf_model, import_hf, save_hf

# The imported Mixtral (test_hf.SMALL): dim 32, 4 heads, top-2 of 4 experts, softmax,
# renormalised, rms eps 1e-6, dropless. Only head_dim changes a parameter's shape.
CHANGES = {  # key: (the value set, as JSON; the checkpoint's, as JSON)
    "model.n_heads": ("2", "4"),
    "model.n_kv_heads": ("2", "4"),
    "model.head_dim": ("16", "null"),
    "model.norm_eps": ("1e-05", "1e-06"),
    "moe.top_k": ("1", "2"),
    "moe.router_scoring": ('"sigmoid"', '"softmax"'),
    "moe.renormalize": ("false", "true"),
    "moe.capacity_factor": ("1.5", "null"),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_arch")
    import_hf(save_hf(hf_model(), root / "hf"), root / "ckpt")
    return root / "ckpt"


def estimate(ckpt, *sets: str) -> list[str]:
    return ["estimate", "--nproc", "1", "--device", "cpu", "--set", "moe.ep_size=1",
            "--set", f"checkpoint.load={ckpt}", *(a for s in sets for a in ("--set", s))]


def one_error_line(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("moezero: error: "), (code, err)
    return err[0]


def test_every_changed_key_is_an_architecture_key():
    assert set(CHANGES) <= set(ARCHITECTURE_KEYS)


@pytest.mark.parametrize("key", CHANGES)
def test_another_value_of_an_architecture_key_is_refused_naming_both(ckpt, capsys, key):
    ours, theirs = CHANGES[key]
    capsys.readouterr()
    line = one_error_line(capsys, main(estimate(ckpt, f"{key}={ours}")))
    assert line.startswith(f"moezero: error: {key}: {ours} differs from the checkpoint's {theirs}; "
                           "to change it deliberately, add it to checkpoint.allow_arch_change "
                           f"(checkpoint {ckpt}"), line


def test_the_same_value_set_explicitly_is_accepted(ckpt, capsys):
    assert main(estimate(ckpt, "model.n_heads=4", "moe.top_k=2")) == 0


def test_allow_arch_change_names_only_architecture_keys(ckpt, capsys):
    capsys.readouterr()
    line = one_error_line(capsys, main(estimate(ckpt, "checkpoint.allow_arch_change=[train.steps]")))
    assert "checkpoint.allow_arch_change.0: Input should be 'model.vocab_size'" in line
    assert "got 'train.steps'" in line


def test_a_shape_change_is_refused_by_name_and_allowed_only_to_the_shape_check(ckpt, capsys):
    capsys.readouterr()
    line = one_error_line(capsys, main(estimate(ckpt, "model.ffn_dim=64")))
    assert "model.ffn_dim: 64 differs from the checkpoint's 48" in line
    code = main(["train", "--set", f"checkpoint.load={ckpt}", "--set", "model.ffn_dim=64",
                 "--set", "checkpoint.allow_arch_change=[model.ffn_dim]",
                 "--out", str(ckpt.parent / "run_ffn")])
    line = one_error_line(capsys, code)
    assert line.startswith("moezero: error: checkpoint.load:")
    assert "has shape (48, 32) in the checkpoint, (64, 32) in the model" in line


def test_an_allowed_change_resumes_with_the_new_value(ckpt, tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "--nproc", "1", "--set", f"checkpoint.load={ckpt}",
                 "--set", "moe.ep_size=1", "--set", "moe.top_k=1", "--set", "train.steps=1",
                 "--set", "train.eval_every=0", "--set", "checkpoint.allow_arch_change=[moe.top_k]",
                 "--out", str(run)])
    assert code == 0, capsys.readouterr().err
    saved = store.read_manifest(store.find_latest(run / "checkpoints")).config
    assert saved["moe"]["top_k"] == 1 and saved["model"]["n_heads"] == 4  # n_heads adopted
