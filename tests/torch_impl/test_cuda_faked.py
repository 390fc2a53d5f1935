"""CUDA-path decisions tested on CPU with the CUDA facts faked (issue 29).

No GPU runs these: each test fakes what the code branches on (``torch.cuda.is_available``,
the device capability, a stream API that must not be touched) or calls the pure decision
the code makes. What only a GPU can show is in the ``gpu``-marked tests
(``tests/torch_impl/test_gpu.py``).
"""

from __future__ import annotations

import shutil
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from moezero import cli
from moezero.config import load_config
from moezero.engine import Engine
from moezero.memory.pinned import PinnedPool
from moezero.model.experts import SwiGLU, grouped_kernel_ok
from moezero.model.moe import MoE
from moezero.model.router import Router, RouterOptions
from moezero.offload.aio import AsyncIO
from moezero.offload.state import SwapState
from moezero.train import model_numel
from moezero.zero.transfer import HostTransfer
from tests.support.fake_cuda import fake_gpus, fake_launch

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
        "--set", "model.ffn_dim=32", "--set", "moe.num_experts=4", "--set", "train.seq_len=16",
        "--set", "train.micro_batch_size=2", "--set", "moe.ep_size=1"]


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


def test_swap_check_sizes_auto_precision_as_bf16_on_a_gpu(monkeypatch, tmp_path, capsys):
    """Item 3: ``precision.dtype: auto`` is bf16 on a GPU, so stage 3 with both tiers on NVMe
    needs 12 + 2 + 2 bytes per element (master and moments, bf16 gradient, bf16 param shard),
    not 12 + 4 + 4: with room for 18 the run must start (the old check refused it)."""
    fake_gpus(monkeypatch, 1)
    launched = fake_launch(monkeypatch)
    swap = tmp_path / "nvme"
    swap.mkdir()
    nvme = ["--set", "zero_optimization.stage=3",
            "--set", "zero_optimization.offload_optimizer.device=nvme",
            "--set", f"zero_optimization.offload_optimizer.nvme_path={swap}",
            "--set", "zero_optimization.offload_param.device=nvme",
            "--set", f"zero_optimization.offload_param.nvme_path={swap}"]
    overrides = [a for a in TINY + nvme if a != "--set"]
    numel = model_numel(load_config(None, overrides))
    real = shutil.disk_usage
    monkeypatch.setattr(  # the swap path's filesystem only: the run directory's is real
        "moezero.offload.swapdir.shutil.disk_usage",
        lambda path: real(path)._replace(free=18 * numel) if str(path).startswith(str(swap))
        else real(path))
    code = cli.main(["train", *TINY, *nvme, "--out", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err
    assert launched == {"nproc": 1, "backend": "nccl"}


@pytest.mark.parametrize("version,device,cap,dtype,dim,ffn,ok", [
    ("2.13.0", "cpu", None, torch.float32, 36, 60, True),
    ("2.13.0", "cpu", None, torch.bfloat16, 36, 60, True),
    ("2.9.1", "cpu", None, torch.float32, 32, 64, False),   # no public F.grouped_mm
    ("2.4.0", "cuda", (9, 0), torch.bfloat16, 32, 64, False),
    ("2.10.0", "cuda", (9, 0), torch.bfloat16, 32, 64, True),  # H100/H200
    ("2.13.0+cu130", "cuda", (9, 0), torch.bfloat16, 32, 64, True),
    ("2.13.0", "cuda", (10, 0), torch.bfloat16, 32, 64, False),  # B200: zero-token grad bug
    ("2.13.0", "cuda", (8, 0), torch.bfloat16, 32, 64, False),   # A100: syncing fallback
    ("2.13.0", "cuda", (9, 0), torch.float32, 32, 64, False),
    ("2.13.0", "cuda", (9, 0), torch.float16, 32, 64, False),
    ("2.13.0", "cuda", (9, 0), torch.bfloat16, 36, 64, False),  # 72-byte rows: not 16-aligned
    ("2.13.0", "cuda", (9, 0), torch.bfloat16, 32, 68, False),
    ("2.13.0", "meta", None, torch.bfloat16, 32, 64, False),
])
def test_grouped_gate_table(version, device, cap, dtype, dim, ffn, ok):
    """Item 5's decision: torch version x device/capability x dtype x shapes."""
    assert grouped_kernel_ok(torch_version=version, device_type=device, capability=cap,
                             dtype=dtype, dim=dim, ffn_dim=ffn) is ok


@pytest.mark.parametrize("cap,version,dim,ok", [
    ((9, 0), "2.13.0", 32, True),
    ((10, 0), "2.13.0", 32, False),
    ((9, 0), "2.4.0", 32, False),
    ((9, 0), "2.13.0", 36, False),
])
def test_moe_takes_the_loop_where_the_grouped_kernel_is_not_trusted(monkeypatch, cap, version,
                                                                    dim, ok):
    """Item 5 through the layer: a bf16 input on a faked CUDA device of capability ``cap``
    (old code: grouped on 10.x, on torch < 2.10 and with unaligned rows)."""
    fake_gpus(monkeypatch, 1, capability=cap)
    monkeypatch.setattr(torch, "__version__", version)
    moe = MoE(dim, SwiGLU(dim, 64), num_experts=4)
    x = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)
    assert moe.uses_grouped(x) is ok


def test_router_counts_expert_loads_without_bincount(monkeypatch):
    """Item 6: ``torch.bincount`` syncs with the host on CUDA (once per MoE layer per
    forward); the expert-bias loads must come from a static-shape scatter-add."""
    def bincount(*args, **kwargs):
        raise AssertionError("torch.bincount: a host sync per MoE layer on CUDA")

    torch.manual_seed(0)
    router = Router(16, 6, 2, RouterOptions(expert_bias=True)).train()
    monkeypatch.setattr(torch, "bincount", bincount)
    x = torch.randn(40, 16)
    _, _, _, experts_Tk = router(x)
    _, _, _, again_Tk = router(x[:7])
    chosen = Counter(experts_Tk.flatten().tolist()) + Counter(again_Tk.flatten().tolist())
    assert router.pending_load.tolist() == [chosen[e] for e in range(6)]


class _Event:
    """A fake ``torch.cuda.Event``: remembers whether the host waited for it."""

    made: list = []

    def __init__(self):
        self.recorded = self.synchronized = False
        _Event.made.append(self)

    def record(self, stream=None):
        self.recorded = True

    def synchronize(self):
        self.synchronized = True


class _Gds:
    """A fake ``torch.cuda.gds.GdsFile``: each move notes whether the stream was waited for."""

    def __init__(self):
        self.moves = []

    def save_storage(self, storage, offset):
        self.moves.append(("write", all(e.synchronized for e in _Event.made)))

    def load_storage(self, storage, offset):
        self.moves.append(("read", all(e.synchronized for e in _Event.made)))


@pytest.mark.parametrize("op", ["write", "read"])
def test_gpudirect_waits_for_the_tensor_stream_before_moving(monkeypatch, tmp_path, op):
    """Item 7: the GPUDirect path handed the storage to a worker thread without waiting for
    the kernels that produce (write) or still read (read) it."""
    _Event.made = []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    path = str(tmp_path / "swap.bin")
    gds = _Gds()
    with AsyncIO(workers=1) as aio:
        aio._gds = {path: gds}  # cuFile "works"; the tensor stands in for a CUDA one
        aio._cuda(op, path, torch.zeros(64), 0).result(timeout=10)
    assert gds.moves == [(op, True)] and _Event.made and _Event.made[0].recorded


def test_micro_batch_reaches_the_gpu_pinned_and_non_blocking(monkeypatch):
    """Item 9: ``Engine.forward`` copied each micro-batch from pageable memory with a blocking
    ``to(device)``: the host waited for every queued kernel before the next forward."""
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self, *a: calls.append("pin_memory") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(
        ("to", *a, k.get("non_blocking", False))) or self)
    engine = Engine.__new__(Engine)  # forward reads only these two
    engine.device = torch.device("cuda", 0)
    engine.model = SimpleNamespace(loss=lambda batch, **parts: (batch, parts))
    batch = torch.zeros(2, 5, dtype=torch.long)
    assert engine.forward(batch)[0] is batch
    assert calls == ["pin_memory", ("to", engine.device, True)]


@pytest.fixture
def registered(monkeypatch):
    """cudaHostRegister/Unregister faked: ``{ptr: nbytes}`` of what is page-locked now."""
    pinned: dict[int, int] = {}
    monkeypatch.setattr("moezero.memory.pinned.cuda_register",
                        lambda ptr, nbytes: pinned.__setitem__(ptr, nbytes))
    monkeypatch.setattr("moezero.memory.pinned.cuda_unregister", lambda ptr: pinned.pop(ptr))
    return pinned


def test_pinned_pool_is_bounded_by_the_buffers_in_use(registered):
    """Item 4: each buffer is pinned at its exact aligned size (PyTorch's pinned allocator
    rounds 12004 bytes up to 16384 and keeps freed blocks) and reused by later steps."""
    pool = PinnedPool()
    sizes = [(1000, torch.float32), (3001, torch.float32), (5, torch.bfloat16)]
    window = [4096, 12288, 4096]  # ALIGN-rounded bytes of the three buffers
    for _ in range(5):  # five steps, two windows alive at once (one read ahead)
        first = [pool.take(n, dt) for n, dt in sizes]
        second = [pool.take(n, dt) for n, dt in sizes]
        assert all(b.data_ptr() % 4096 == 0 for b in first + second)
        assert [b.numel() for b in first] == [n for n, _ in sizes]
        assert len({b.data_ptr() for b in first + second}) == 6  # never handed out twice
        del first, second
    assert sorted(registered.values()) == sorted(window * 2)
    assert pool.pinned_bytes == 2 * sum(window)
    pool.close()
    assert registered == {} and pool.pinned_bytes == 0


def test_swap_windows_on_cuda_reuse_their_pinned_buffers(monkeypatch, registered):
    """Item 4 through the NVMe tier: ten read/drop cycles of one slot's three states pin three
    buffers once (old code: a fresh ``pin_memory=True`` block per cycle)."""
    fake_gpus(monkeypatch, 1)
    state = SwapState(None, None, [], ("master", "exp_avg", "exp_avg_sq"), torch.float32,
                      key="zero_optimization.offload_optimizer.nvme_path", pin=True)
    slot = SimpleNamespace(shard=3001)
    for _ in range(10):
        bufs = state.buffers(slot)
        assert all(b.numel() == 3001 for b in bufs.values())
        state.drop(bufs)
        del bufs
    assert sorted(registered.values()) == [12288] * 3
