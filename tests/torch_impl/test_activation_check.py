"""A micro-batch whose activations cannot fit is refused before any rank starts (issue 38,
item 11): ``--set train.seq_len=1e8`` ran a first step for 14 minutes and then died of a
memory error inside a rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from moezero.config import load_config
from moezero.config.errors import ConfigError
from moezero.memory_check import check_activation_memory
from tests.torch_impl.test_cli import TINY


@pytest.mark.parametrize("setting", ["train.seq_len=1e8", "train.micro_batch_size=1e8"])
def test_a_micro_batch_too_large_for_memory_is_one_line_before_any_rank(tmp_path, setting):
    proc = subprocess.Popen([sys.executable, "-m", "moezero.cli", "train", *TINY, "--set",
                             setting, "--set", "train.steps=1", "--out", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, err[-3000:]
    key = setting.split("=")[0]
    assert lines[0].startswith("moezero: error: train.micro_batch_size × train.seq_len: "), lines
    assert "of activations per rank" in lines[0] and key.split(".")[1] in lines[0], lines


def test_the_check_compares_with_the_memory_of_a_rank():
    cfg = load_config(None, ["train.seq_len=4096", "train.micro_batch_size=8"])
    check_activation_memory(cfg, device="cpu", memory_bytes=1 << 50, local_ranks=2)
    with pytest.raises(ConfigError, match=r"more than the 0\.5 GiB of host memory per rank"):
        check_activation_memory(cfg, device="cpu", memory_bytes=1 << 30, local_ranks=2)
