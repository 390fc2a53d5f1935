"""The kill-the-launcher loop (``tests/faults/kill_launcher.py``) twice, on the default recipe
cut to a few steps: each kill keeps the interrupted step, and the resume is bitwise."""

from __future__ import annotations

import pytest

from tests.faults import kill_launcher


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_killing_the_launcher_at_random_moments_keeps_every_step(tmp_path, capsys):
    code = kill_launcher.main(["--runs", "2", "--steps", "8", "--work", str(tmp_path),
                               "--seed", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("resumed bitwise") == 2, out
