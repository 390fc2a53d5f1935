"""Host synchronisations of one MoE layer: none at ep = 1 with the grouped experts, one (the
all-to-all sizes) at ep > 1, none in the backward. Counted on CPU by ``tests.torch_impl.syncs``
(whose own tests show it catches each kind of sync); on a GPU by CUDA's sync debug mode."""

from __future__ import annotations

import pytest
import torch

from moezero.model.moe import MoE
from tests.support.world import run_world
from tests.torch_impl.syncs import HostSyncs
from tests.torch_impl.test_grouped import CASES, layer_inputs, make_layer

_t = torch.arange(6)
SYNCING = {
    "tolist": lambda: _t.tolist(),
    "item": lambda: _t.sum().item(),
    "int": lambda: int(_t[2]),
    "bool": lambda: bool(_t[2] > 1),
    "cpu": lambda: _t.cpu(),
    "numpy": lambda: _t.numpy(),
    "boolean mask index": lambda: _t[_t > 2],
    "boolean mask assignment": lambda: _t.clone().__setitem__(_t > 2, 0),
    "nonzero": lambda: _t.nonzero(),
    "masked_select": lambda: _t.masked_select(_t > 2),
    "bincount": lambda: _t.bincount(minlength=8),
    "unique": lambda: _t.unique(),
    "repeat_interleave without output_size": lambda: _t.repeat_interleave(_t),
}
NOT_SYNCING = {
    "repeat_interleave with output_size": lambda: _t.repeat_interleave(_t, output_size=15),
    "argsort": lambda: _t.argsort(stable=True),
    "searchsorted": lambda: torch.searchsorted(_t, torch.arange(3)),
    "index_select": lambda: _t.index_select(0, _t),
    "scatter_add_": lambda: torch.zeros(6, dtype=torch.long).scatter_add_(0, _t, _t),
    "integer index": lambda: _t[_t],
}


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_counter_catches_each_kind_of_sync(name):
    with HostSyncs() as syncs:
        SYNCING[name]()
    assert syncs.count == 1, syncs.events


@pytest.mark.parametrize("name", sorted(NOT_SYNCING))
def test_counter_ignores_static_shape_ops(name):
    with HostSyncs() as syncs:
        NOT_SYNCING[name]()
    assert syncs.count == 0, syncs.events


def test_counter_sees_syncs_in_backward():
    x = torch.randn(6, requires_grad=True)
    y = x[torch.tensor([True, False, True, True, False, False])]
    with HostSyncs() as syncs:
        y.sum().backward()
    assert syncs.events == ["index_put with a boolean mask"]


def _layer_syncs(moe: MoE, rank: int = 0) -> tuple[list[str], list[str]]:
    x, probe = layer_inputs(rank)
    x.requires_grad_()
    with HostSyncs() as forward:
        out, aux = moe(x)
    loss = (out * probe).sum() + aux
    with HostSyncs() as backward:
        loss.backward()
    return forward.events, backward.events


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_layer_has_no_sync_at_ep1(case, top_k):
    cf, starved = CASES[case]
    forward, backward = _layer_syncs(make_layer(grouped=True, capacity_factor=cf,
                                                starved=starved, top_k=top_k))
    assert forward == [] and backward == []


def test_generic_loop_costs_one_sync_at_ep1():
    """A user's expert modules need host-known row counts: one read, then none in backward."""
    forward, backward = _layer_syncs(make_layer(grouped=False, capacity_factor=1.0))
    assert forward == ["tolist"] and backward == []


def _ep_syncs(ep: int) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    group = dist.new_group(list(range(ep)))
    return {(case, grouped): _layer_syncs(make_layer(grouped=grouped, capacity_factor=cf,
                                                     starved=starved, ep=ep, rank=rank,
                                                     group=group), rank)
            for case, (cf, starved) in CASES.items() for grouped in (True, False)}


@pytest.mark.parametrize("ep", [2, 4])
def test_one_sync_per_layer_forward_at_ep_above_1(tmp_path, ep):
    for by_case in run_world(_ep_syncs, ep, tmp_path, ep):
        for (case, grouped), (forward, backward) in by_case.items():
            assert forward == ["tolist"], (case, grouped, forward)  # the all-to-all sizes
            assert backward == [], (case, grouped, backward)


# ------------------------------------------------------------------------------------ GPU


_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _SM90, reason="needs a CUDA GPU of compute capability 9.x "
                                      "(torch's grouped GEMM kernels; elsewhere it syncs)")
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_layer_forward_and_backward_never_sync(case):
    cf, starved = CASES[case]
    moe = make_layer(grouped=None, capacity_factor=cf, starved=starved,
                     dtype=torch.bfloat16).cuda()
    x, probe = (t.cuda() for t in layer_inputs(0, torch.bfloat16))
    x.requires_grad_()
    assert moe.uses_grouped(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, aux = moe(x)
        ((out.float() * probe.float()).sum() + aux).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fp32_takes_the_loop_not_torchs_syncing_fallback():
    x = layer_inputs(0)[0].cuda()
    assert not make_layer(grouped=None, capacity_factor=None).cuda().uses_grouped(x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_generic_loop_is_caught_by_sync_debug_mode():
    """The GPU check has teeth: the loop path's one host read raises in 'error' mode."""
    moe = make_layer(grouped=False, capacity_factor=None).cuda()
    x = layer_inputs(0)[0].cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            moe(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")

