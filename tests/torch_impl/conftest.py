"""Build (or load) the compiled host AdamW once in the pytest process, before any test spawns
ranks: on a fresh machine the first build takes about a minute, which ranks would otherwise
spend at their first step while others wait (``moezero.zero.hostadam``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _host_adamw_built():
    from moezero.zero.hostadam import load_compiled

    load_compiled()
