"""Grouped-GEMM SwiGLU experts (moezero.model.experts) equal the per-expert loop.

Forward and every gradient at ep 1, 2 and 4 (gloo ranks), dropless, with capacity drops, and
with experts that receive no token; bf16 runs; the stacking rule (views at ZeRO stages 1-2,
copies elsewhere); user modules keep the loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moezero.model.dispatch import capacity
from moezero.model.experts import (
    SwiGLU,
    grouped_swiglu,
    has_grouped_kernel,
    stacking_mode,
    strided_view,
)
from moezero.model.moe import MoE, aux_losses, route
from tests.support.compare import rel_err
from tests.support.world import run_world
from tests.torch_impl.tolerances import GROUPED_RTOL, ORACLE_RTOL, RTOL

D, HIDDEN, E, T = 16, 32, 8, 24
STARVED = (2, 3)  # at ep 4 these are EP rank 1's two experts: that rank receives no row
CASES = {  # name -> (capacity_factor, starved experts)
    "dropless": (None, ()),
    "drops": (0.75, ()),
    "starved": (1.0, STARVED),
}


def make_layer(*, grouped: bool | None, capacity_factor, starved=(), top_k: int = 2, ep: int = 1,
               rank: int = 0, group=None, dtype=torch.float32) -> MoE:
    """A MoE whose weights depend only on global expert indices (equal for any ep)."""
    def expert(e: int) -> SwiGLU:
        torch.manual_seed(100 + e)
        return SwiGLU(D, HIDDEN)

    moe = MoE(D, expert, num_experts=E, top_k=top_k, capacity_factor=capacity_factor,
              ep_size=ep, ep_rank=rank, ep_group=group, grouped=grouped)
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(E, D, generator=torch.Generator().manual_seed(1)))
        for e in starved:  # inputs carry a constant feature 0 = 1: these never win
            moe.router.weight[e, 0] = -50.0
    return moe.to(dtype)


def layer_inputs(rank: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(T, D, generator=gen)
    x[:, 0] = 1.0
    return x.to(dtype), torch.randn(T, D, generator=gen).to(dtype)


def forward_backward(moe: MoE, x: torch.Tensor, probe: torch.Tensor) -> dict:
    """Output, d/dx and every parameter's gradient of ``sum(out * probe) + aux``."""
    x = x.clone().requires_grad_()
    out, aux = moe(x)
    ((out.float() * probe.float()).sum() + aux).backward()
    grads = {n: p.grad.float().clone() if p.grad is not None else torch.zeros_like(p).float()
             for n, p in moe.named_parameters()}
    return {"out": out.detach().float(), "dx": x.grad.float(), "grads": grads,
            "kept_E": moe.last_stats["tokens_per_expert"].clone(),
            "dropped": int(moe.last_stats["dropped"])}


def both_paths(case: str, *, ep: int = 1, rank: int = 0, group=None, top_k: int = 2,
               dtype=torch.float32) -> dict:
    cf, starved = CASES[case]
    x, probe = layer_inputs(rank, dtype)
    return {grouped: forward_backward(make_layer(grouped=grouped, capacity_factor=cf,
                                                 starved=starved, top_k=top_k, ep=ep,
                                                 rank=rank, group=group, dtype=dtype), x, probe)
            for grouped in (True, False)}


def assert_paths_equal(runs: dict, rtol: float) -> None:
    grouped, loop = runs[True], runs[False]
    assert rel_err(grouped["out"], loop["out"]) <= rtol
    assert rel_err(grouped["dx"], loop["dx"]) <= rtol
    assert grouped["grads"].keys() == loop["grads"].keys()
    for name, g in grouped["grads"].items():
        assert rel_err(g, loop["grads"][name]) <= rtol, name
    assert torch.equal(grouped["kept_E"], loop["kept_E"])


def assert_case_happened(case: str, runs: dict) -> None:
    """The case is not vacuous: drops happen, starved experts get nothing, others do."""
    kept_E = runs[True]["kept_E"]
    if case == "dropless":
        assert runs[True]["dropped"] == 0
    else:
        assert runs[True]["dropped"] > 0
    if case == "starved":
        assert all(kept_E[e] == 0 for e in STARVED) and kept_E.sum() > 0


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_equals_loop_single_process(case, top_k):
    runs = both_paths(case, top_k=top_k)
    assert_case_happened(case, runs)
    assert_paths_equal(runs, GROUPED_RTOL["fp32"])


def doc_keep(experts_Tk: torch.Tensor, cap: int | None) -> list[list[bool]]:
    """docs/model.md's drop order, written out: choice-major, then token; first C per expert."""
    used, keep = [0] * E, [[False] * experts_Tk.shape[1] for _ in range(experts_Tk.shape[0])]
    for j in range(experts_Tk.shape[1]):
        for t in range(experts_Tk.shape[0]):
            e = int(experts_Tk[t, j])
            keep[t][j] = cap is None or used[e] < cap
            used[e] += 1
    return keep


def naive_forward_backward(moe: MoE, x: torch.Tensor, probe: torch.Tensor) -> dict:
    """The layer token by token, with no dispatch code: an oracle for plan, gathers, combine."""
    x = x.clone().requires_grad_()
    logits = x.float() @ moe.router.weight.float().T
    probs, gates, experts = route(logits, moe.top_k)
    aux, z = aux_losses(logits, probs, experts, E)
    keep = doc_keep(experts, capacity(T, E, moe.top_k, moe.capacity_factor))
    rows = [sum((gates[t, j] * moe.experts[str(int(experts[t, j]))](x[t:t + 1])[0]
                 for j in range(moe.top_k) if keep[t][j]), torch.zeros(D)) for t in range(T)]
    out = torch.stack(rows)
    ((out * probe).sum() + moe.aux_loss_coef * aux + moe.z_loss_coef * z).backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
             for n, p in moe.named_parameters()}
    return {"out": out.detach(), "dx": x.grad, "grads": grads}


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_layer_equals_a_per_token_oracle(case, top_k):
    cf, starved = CASES[case]
    x, probe = layer_inputs(0)
    moe = make_layer(grouped=True, capacity_factor=cf, starved=starved, top_k=top_k)
    got = forward_backward(moe, x, probe)
    moe.zero_grad()
    want = naive_forward_backward(moe, x, probe)
    for key in ("out", "dx"):
        assert rel_err(got[key], want[key]) <= RTOL["fp32"], key
    for name, g in want["grads"].items():
        assert rel_err(got["grads"][name], g) <= ORACLE_RTOL["fp32"], name


def _ep_world(ep: int) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    group = dist.new_group(list(range(ep)))
    return {case: both_paths(case, ep=ep, rank=rank, group=group) for case in CASES}


@pytest.mark.parametrize("ep", [2, 4])
def test_grouped_equals_loop_expert_parallel(tmp_path, ep):
    by_rank = run_world(_ep_world, ep, tmp_path, ep)
    for case in CASES:
        for runs in by_rank:
            assert_paths_equal(runs[case], GROUPED_RTOL["fp32"])
        kept = torch.stack([r[case][True]["kept_E"] for r in by_rank])
        assert_case_happened(case, {True: {"kept_E": kept.sum(0),
                                           "dropped": sum(r[case][True]["dropped"] for r in by_rank)}})
    # at ep 4, EP rank 1 holds only starved experts: its grouped GEMMs ran on zero rows
    assert ep != 4 or all(by_rank[1]["starved"][True]["grads"][f"experts.{e}.w1.weight"].abs().sum() == 0
                          for e in STARVED)


@pytest.fixture
def nan_for_uninitialised():
    """Deterministic mode fills fresh tensors with NaN, so rows the grouped GEMMs leave
    undefined (dropped assignments) are NaN instead of whatever the allocator returned."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("case", ["drops", "starved"])
def test_undefined_rows_of_dropped_assignments_never_leak(nan_for_uninitialised, case):
    runs = both_paths(case)
    assert runs[True]["dropped"] > 0
    assert torch.isfinite(runs[True]["out"]).all() and torch.isfinite(runs[True]["dx"]).all()
    assert_paths_equal(runs, GROUPED_RTOL["fp32"])


@pytest.mark.parametrize("case", ["dropless", "starved"])
def test_bf16_grouped_runs_forward_and_backward(case):
    """grouped_mm's bf16 backward works on CPU and agrees with the bf16 loop to bf16 rounding."""
    runs = both_paths(case, dtype=torch.bfloat16)
    for run in runs.values():
        assert all(torch.isfinite(g).all() for g in run["grads"].values())
    assert_paths_equal(runs, GROUPED_RTOL["bf16"])


# --------------------------------------------------------------------------- stacking rule


def _flat_layout(modules: list[SwiGLU], pad: int = 0) -> torch.Tensor:
    """Params as views of one buffer in ZeRO's kind layout: per expert w1, w2, w3 (plan order)."""
    params = [getattr(m, n).weight for m in modules for n in ("w1", "w2", "w3")]
    flat = params[0].new_empty(pad + sum(p.numel() for p in params))
    pos = pad
    for p in params:
        view = flat[pos:pos + p.numel()].view_as(p)
        view.copy_(p.detach())
        p.data = view
        pos += p.numel()
    return flat


def test_strided_view_shares_storage_and_copies_otherwise():
    mods = [SwiGLU(D, HIDDEN) for _ in range(3)]
    assert stacking_mode(mods) == "copy"  # separate storages
    flat = _flat_layout(mods)
    assert stacking_mode(mods) == "view"
    w1 = strided_view([m.w1.weight for m in mods])
    assert w1.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert torch.equal(w1, torch.stack([m.w1.weight for m in mods]))
    assert strided_view([mods[0].w1.weight, mods[2].w1.weight, mods[1].w1.weight]) is None
    _flat_layout(mods, pad=1)  # 4-byte offset: not 16-byte aligned -> copy
    assert stacking_mode(mods) == "copy"


def test_view_path_gradients_equal_the_loop():
    torch.manual_seed(0)
    mods = [SwiGLU(D, HIDDEN) for _ in range(4)]
    _flat_layout(mods)
    assert stacking_mode(mods) == "view"
    x = torch.randn(10, D, requires_grad=True)
    counts = torch.tensor([3, 0, 5, 2])
    grouped_swiglu(x, counts.cumsum(0).to(torch.int32), mods).square().sum().backward()
    grouped = [p.grad.clone() for m in mods for p in m.parameters()]
    dx, x.grad = x.grad.clone(), None
    for m in mods:
        m.zero_grad()
    torch.cat([m(c) for m, c in zip(mods, x.split(counts.tolist()), strict=True)]).square().sum().backward()
    loop = [p.grad for m in mods for p in m.parameters()]
    assert rel_err(dx, x.grad) <= GROUPED_RTOL["fp32"]
    assert all(rel_err(a, b) <= GROUPED_RTOL["fp32"] for a, b in zip(grouped, loop, strict=True))


def _engine(stage: int, **moe):
    from moezero.distributed.topology import build_topology
    from moezero.engine import initialize
    from moezero.train import build_model
    from tests.torch_impl.test_distributed import small_config

    cfg = small_config(ep_size=1, **moe)
    cfg.zero_optimization.stage = stage
    topo = build_topology([1], num_experts=cfg.moe.num_experts)
    return initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu"), cfg


def _engine_modes(stage: int, **moe) -> list[str]:
    engine, _ = _engine(stage, **moe)
    return [stacking_mode(list(m.experts.values())) for m in engine.model.modules()
            if isinstance(m, MoE)]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_engine_flat_buffers_give_views_at_stages_0_to_2(stage):
    assert _engine_modes(stage) == ["view", "view"]  # stage 3: gathered, the test below


@pytest.mark.parametrize("moe", [{}, {"split_groups_by_expert": False}])
def test_stage3_gathers_a_layers_experts_at_one_stride(monkeypatch, moe):
    """Gathered at stage 3 (one storage per gather unit), a layer's experts stack as views in
    the forward and again in backward: no copy of the layer's expert weights per pass."""
    from moezero.model import experts

    engine, cfg = _engine(3, **moe)
    views = []
    monkeypatch.setattr(experts, "strided_view", lambda ws: views.append(strided_view(ws)) or views[-1])
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1))
    loss, _ = engine.forward(tokens)
    engine.backward(loss)
    engine.step()
    # 2 MoE layers x (forward + backward) x (w1, w3, w2)
    assert len(views) == 12 and all(v is not None for v in views), [v is None for v in views]


@pytest.mark.parametrize("moe", [{"max_group_size": 1000}, {"split_groups_by_expert": False},
                                 {"max_group_size": 1000, "split_groups_by_expert": False}])
def test_views_survive_capped_and_merged_groups(moe):
    """A weight sliced across groups stays contiguous; merged groups keep the expert order."""
    assert _engine_modes(2, **moe) == ["view", "view"]


# --------------------------------------------------------------------------- generic path


class _Relu(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return self.proj(x).relu()


class _ScaledSwiGLU(SwiGLU):
    def forward(self, x):
        return 2 * super().forward(x)


def test_user_modules_keep_the_loop():
    x = torch.randn(2, D)
    assert not MoE(D, _Relu(), num_experts=4).uses_grouped(x)
    assert not MoE(D, _ScaledSwiGLU(D, HIDDEN), num_experts=4).uses_grouped(x)  # its forward
    assert MoE(D, SwiGLU(D, HIDDEN), num_experts=4).uses_grouped(x)
    assert not MoE(D, SwiGLU(D, HIDDEN), num_experts=4, grouped=False).uses_grouped(x)
    with pytest.raises(ValueError, match="built-in SwiGLU"):
        MoE(D, _Relu(), num_experts=4, grouped=True)


def test_grouped_kernels_are_assumed_only_where_torch_has_them():
    shape = {"dim": 32, "ffn_dim": 64}
    assert has_grouped_kernel(torch.device("cpu"), torch.float32, **shape)
    assert has_grouped_kernel(torch.device("cpu"), torch.bfloat16, **shape)
    assert not has_grouped_kernel(torch.device("meta"), torch.bfloat16, **shape)
    assert not has_grouped_kernel(torch.device("cuda"), torch.float32, **shape)  # fallback syncs


# ------------------------------------------------------------------------------------ GPU

_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _SM90, reason="needs a CUDA GPU of compute capability 9.x "
                                      "(torch's grouped GEMM kernels)")
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_grouped_equals_loop_bf16(case):
    cf, starved = CASES[case]
    x, probe = (t.cuda() for t in layer_inputs(0, torch.bfloat16))
    runs = {}
    for grouped in (True, False):
        moe = make_layer(grouped=grouped, capacity_factor=cf, starved=starved,
                         dtype=torch.bfloat16).cuda()
        assert moe.uses_grouped(x) == grouped
        runs[grouped] = forward_backward(moe, x, probe)
    assert_paths_equal(runs, GROUPED_RTOL["bf16"])


@pytest.mark.gpu
@pytest.mark.skipif(not _SM90, reason="needs a CUDA GPU of compute capability 9.x")
def test_cuda_view_path_meets_the_kernel_layout():
    mods = [SwiGLU(D, HIDDEN).cuda().bfloat16() for _ in range(4)]
    _flat_layout(mods)
    assert stacking_mode(mods) == "view"
    x = torch.randn(10, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([3, 3, 8, 10], device="cuda", dtype=torch.int32)
    grouped_swiglu(x, offs, mods).float().square().sum().backward()
    assert torch.isfinite(x.grad).all() and all(m.w1.weight.grad is not None for m in mods)


def _lora_reference(x_ND, counts, mods, p: float) -> torch.Tensor:
    """The experts with LoRA on w1, w3, w2, one dropout mask per projection over every row
    (drawn in the grouped path's order: w1's input, w3's, then w2's), expert by expert."""
    import torch.nn.functional as F

    def proj(lin, x, dropped):
        return F.linear(x, lin.weight) + lin.scale * F.linear(F.linear(dropped, lin.lora_A),
                                                               lin.lora_B)

    d1, d3 = F.dropout(x_ND, p), F.dropout(x_ND, p)
    rows = list(torch.cumsum(torch.tensor([0, *counts]), 0))
    h = torch.cat([F.silu(proj(m.w1, x_ND[a:b], d1[a:b])) * proj(m.w3, x_ND[a:b], d3[a:b])
                   for m, a, b in zip(mods, rows[:-1], rows[1:], strict=True)])
    d2 = F.dropout(h, p)
    return torch.cat([proj(m.w2, h[a:b], d2[a:b])
                      for m, a, b in zip(mods, rows[:-1], rows[1:], strict=True)])


def test_lora_dropout_applies_on_the_grouped_expert_path():
    """``peft.dropout > 0`` with adapters on the experts: the grouped path drops the adapters'
    inputs as the reference does, and only in training (issue 38: no test set a dropout, and a
    grouped path that skipped it survived)."""
    from moezero.model.lora import LoraOptions, add_adapter

    torch.manual_seed(0)
    options, p = LoraOptions(r=4, alpha=8.0, dropout=0.5, targets=("experts",)), 0.5
    mods = [SwiGLU(D, HIDDEN) for _ in range(4)]
    for m in mods:
        for lin in (m.w1, m.w3, m.w2):
            add_adapter(lin, options)
            nn.init.normal_(lin.lora_A)
            nn.init.normal_(lin.lora_B)
    x, counts = torch.randn(10, D), [3, 0, 5, 2]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    torch.manual_seed(1)
    grouped = grouped_swiglu(x, offs, mods)
    torch.manual_seed(1)
    want = _lora_reference(x, counts, mods, p)
    torch.testing.assert_close(grouped, want, rtol=RTOL["fp32"], atol=1e-5)
    for m in mods:
        m.eval()
    torch.manual_seed(1)
    undropped = grouped_swiglu(x, offs, mods)
    assert not torch.allclose(undropped, grouped)
    torch.testing.assert_close(undropped, _lora_reference(x, counts, mods, 0.0),
                               rtol=RTOL["fp32"], atol=1e-5)
