"""The ``train.deterministic`` switch: deterministic CUDA kernels for the whole process.

moezero's own MoE dispatch is deterministic either way: rows move by gathers whose backward
is again a gather, the combine sums each token's k outputs in a fixed order, and no
``index_add_``/atomic scatter touches floating-point data (``moezero.model.dispatch``).
What the switch adds, on CUDA only, is torch's deterministic mode for everything else the
step runs: ``torch.use_deterministic_algorithms(True)`` (SDPA backward takes its
deterministic variants and excludes cuDNN attention; ``scatter_add_``/``index_add_`` and
friends take their sorted kernels; an op with no deterministic kernel raises), cuDNN without
benchmarking, and cuBLAS with a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, which cuBLAS
reads once, when a handle is created: ``moezero train`` exports it before any rank starts; the
engine sets it only while CUDA has not started in the process, and otherwise refuses in one
line, since a later setting would leave cuBLAS non-deterministic or every GEMM raising). On CPU the kernels moezero uses are already deterministic and nothing is
changed (deterministic mode would also NaN-fill every new tensor). Guarantees and costs:
docs/model.md ("Determinism").
"""

from __future__ import annotations

import os

import torch

from moezero.config.errors import ConfigError

CUBLAS_WORKSPACE = ":4096:8"
DETERMINISTIC_WORKSPACES = (CUBLAS_WORKSPACE, ":16:8")  # the values torch's check accepts


def workspace_problem(value: str | None, cuda_started: bool) -> str | None:
    """Why deterministic cuBLAS cannot be had with ``CUBLAS_WORKSPACE_CONFIG=value`` in a
    process where CUDA has (``cuda_started``) or has not started yet; None when it can (unset
    and not started: it may still be set)."""
    if value in DETERMINISTIC_WORKSPACES or (value is None and not cuda_started):
        return None
    if value is None:
        return ("CUBLAS_WORKSPACE_CONFIG is unset and CUDA already ran in this process "
                f"(cuBLAS reads it once); export CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} "
                "before starting")
    return (f"CUBLAS_WORKSPACE_CONFIG={value} is not deterministic; use one of "
            f"{', '.join(DETERMINISTIC_WORKSPACES)}")


def configure(enabled: bool, device: torch.device) -> None:
    """Select deterministic kernels when ``enabled`` and ``device`` is CUDA; otherwise leave
    torch's settings as they are (a caller may have chosen them). ``ConfigError`` (one line,
    ``train.deterministic``) when cuBLAS cannot be made deterministic any more."""
    if not enabled or device.type != "cuda":
        return
    problem = workspace_problem(os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                                torch.cuda.is_initialized())
    if problem is not None:
        raise ConfigError("train.deterministic", problem, "process environment")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
