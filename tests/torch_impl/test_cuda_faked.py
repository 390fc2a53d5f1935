"""CUDA-path decisions tested on CPU with the CUDA facts faked (issue 29).

No GPU runs these: each test fakes what the code branches on (``torch.cuda.is_available``,
the device capability, a stream API that must not be touched) or calls the pure decision
the code makes. What only a GPU can show is in the ``gpu``-marked tests
(``tests/torch_impl/test_gpu.py``).
"""

from __future__ import annotations

import torch

from moezero.zero.transfer import HostTransfer


def _no_cuda_api(*args, **kwargs):
    raise AssertionError("a CUDA stream API was called for host tensors")


def test_to_host_passes_host_tensors_without_streams(monkeypatch):
    """Item 2: stage 3 with the optimizer on NVMe hands ``to_host`` host tensors; the CUDA
    path called ``record_stream`` on them (NotImplementedError on a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    transfer = HostTransfer(torch.device("cuda", 0))
    assert transfer.cuda
    for name in ("current_stream", "stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, _no_cuda_api)
    grads = [torch.randn(5), torch.randn(2, 3)]
    staged = transfer.to_host(grads)
    assert all(a is b for a, b in zip(staged.wait(), grads, strict=True))
