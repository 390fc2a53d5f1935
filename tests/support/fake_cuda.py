"""Fake the CUDA facts moezero branches on, for CPU tests of the GPU path (issue 29)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def fake_gpus(monkeypatch, count: int = 1, capability: tuple[int, int] = (9, 0),
              memory: int = 80 << 30) -> list:
    """``torch.cuda`` reports ``count`` bf16 devices of ``capability`` with ``memory`` bytes
    each (an 80 GB H100 by default); returns the list that records ``set_device`` calls
    (nothing is placed)."""
    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a, **k: SimpleNamespace(total_memory=memory))
    return calls


def fake_launch(monkeypatch) -> dict:
    """``moezero train`` stops at the launch: the layout it would start is recorded."""
    seen: dict = {}

    def launch(fn, args, *, nproc, backend, timeout_s, preempt=None, watch=None):
        seen.update(nproc=nproc, backend=backend)
        return 0

    monkeypatch.setattr("moezero.train.launch", launch)
    return seen
