"""Ctrl-C during ``moezero import-deepspeed`` (issue 38, item 11): one line, exit 130, and
nothing left at ``--out``, wherever the interrupt lands (it was a 25-line traceback).

Each case runs the CLI in a child process (a ``KeyboardInterrupt`` escaping into pytest would
stop the whole session) with one importer function replaced by one that raises
``KeyboardInterrupt`` at its n-th call, as SIGINT does at that moment.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.torch_impl.test_deepspeed_import import FIXTURES

SCRIPT = """
import sys
from moezero.checkpoint.deepspeed import importer
from moezero.cli import main

name, nth = sys.argv[1], int(sys.argv[2])
real, calls = getattr(importer, name), [0]

def interrupted(*args, **kwargs):
    calls[0] += 1
    if calls[0] == nth:
        raise KeyboardInterrupt
    return real(*args, **kwargs)

setattr(importer, name, interrupted)
sys.exit(main(["import-deepspeed", sys.argv[3], "--out", sys.argv[4]]))
"""

POINTS = {"reading rank 0": ("_read_rank", 1), "writing rank 1": ("_write_rank", 2),
          "writing config.yaml": ("dump_config", 1)}


@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("out_exists", [False, True])
def test_ctrl_c_during_import_deepspeed_is_one_line_and_leaves_nothing(tmp_path, point,
                                                                        out_exists):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "mixtral_z2_w2" / "ckpt", ckpt)
    out = tmp_path / "out"
    if out_exists:
        out.mkdir()
    res = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, POINTS[point]), str(ckpt),
                          str(out)], capture_output=True, text=True, timeout=300)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 130 and len(lines) == 1, res.stderr[-3000:]
    assert lines[0] == f"moezero: interrupted: import-deepspeed stopped; nothing was kept in {out}", lines
    assert (list(out.iterdir()) == []) if out_exists else not out.exists()
