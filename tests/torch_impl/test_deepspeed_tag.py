"""``import-deepspeed --tag`` names a folder of the checkpoint given, never a path elsewhere
(issue 38, item 13): ``--tag /another/run/global_step3`` imported another run's tag under this
folder's ``config.json``."""

from __future__ import annotations

import shutil

import pytest

from moezero.cli import main
from tests.torch_impl.test_deepspeed_import import FIXTURES


@pytest.mark.parametrize("how", ["absolute", "relative", "latest"])
def test_a_tag_outside_the_checkpoint_is_refused_in_one_line(tmp_path, capsys, how):
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    for folder in (ckpt, other):
        shutil.copytree(FIXTURES / "mixtral_z2_w2" / "ckpt", folder)
    tag = {"absolute": str(other / "global_step2"), "relative": "../other/global_step2",
           "latest": None}[how]
    if how == "latest":
        (ckpt / "latest").write_text("../other/global_step2")
    args = ["import-deepspeed", str(ckpt), "--out", str(tmp_path / "out")]
    code = main(args + ([] if tag is None else ["--tag", tag]))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "not a folder of" in err[0] and str(ckpt) in err[0], err[0]
    assert not (tmp_path / "out").exists()
