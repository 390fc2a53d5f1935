"""``rundir.check_run``'s own lock check, apart from the ranks' (issue 38: removing it
survived every test, since the ranks refuse the directory too, later)."""

from __future__ import annotations

import pytest

from moezero.config import ConfigError
from moezero.rundir import RunLock, check_run


def test_check_run_refuses_a_run_directory_a_live_run_holds(tmp_path):
    run = tmp_path / "run"
    with RunLock(run):  # a live run (another open file: flock refuses it in this process too)
        with pytest.raises(ConfigError, match=r"--out: the run directory is in use by a "
                                              r"running job \(pid \d+ on "):
            check_run(run, run / "checkpoints", 0)
        check_run(run, run / "checkpoints", 0, lock=False)  # a torchrun worker, not rank 0
    check_run(run, run / "checkpoints", 0)  # released: the finished run's directory is free
