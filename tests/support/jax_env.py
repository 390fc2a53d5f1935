"""The environment a JAX test suite sets before JAX is first imported (its conftest calls
``configure_jax`` at import time): forced host devices for the sharded tests, and XLA's
optimisations off for tiny programs.

Only environment variables: importing this module imports nothing of JAX.
"""

from __future__ import annotations

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def configure_jax(host_devices: int = 4) -> None:
    """Give XLA ``host_devices`` CPU devices (unless XLA_FLAGS already sets a count) and, unless
    set, ``JAX_DISABLE_MOST_OPTIMIZATIONS=1``.

    The suites' programs are tiny: XLA's CPU compile time dominates, and skipping most
    optimisations cuts it 3-5x. Numerics stay IEEE (no fast-math); set
    ``JAX_DISABLE_MOST_OPTIMIZATIONS=0`` to override.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICES_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICES_FLAG}={host_devices}".strip()
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
