"""The one-pass AdamW every tier runs (torch_impl/zero/hostadam.py, csrc/adamw_host.cpp).

Against independent oracles: ``tests/support/adamw.py: adamw_`` (the update math the JAX reference mirrors) and
optax's formula in float64 numpy, within fp32 rounding, for random shapes, weight decay on and
off, step 1 and step 10⁴ (bias correction). The compiled kernel and its torch-ops fallback agree
to rounding (the moments bit for bit); an element's result does not depend on where it lies in the tensor (the tiers
slice the state differently); a bf16/fp16 gradient is upcast and the compute-dtype param
written in the same pass; the gradient multiplier is the unscale x clip the step used to apply
as two passes. Tier-to-tier bit identity of whole steps: tests/torch_impl/test_host_step.py.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moezero.zero.hostadam import adamw_step_, load_compiled
from tests.support.adamw import adamw_
from tests.torch_impl.tolerances import HOST_ADAMW

ADAM = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
LR = 1e-3


def compiled_kernel() -> None:
    module, why = load_compiled()
    if module is None:  # visible: the fallback is then what every tier runs
        pytest.skip(f"the compiled AdamW kernel did not build here: {why}")


def test_the_kernel_builds_wherever_a_cpp_compiler_is():
    """The kernel tests above skip where the build fails, so a build broken by a change (a
    syntax error, a flag a compiler refuses) would pass unseen: with a compiler on PATH (CI's
    machines have one) the build must succeed."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) on PATH: the torch-ops fallback runs")
    module, why = load_compiled()
    assert module is not None, f"the compiled AdamW kernel did not build with {compiler}: {why}"


def state(n: int, seed: int) -> list[torch.Tensor]:
    """param, grad, exp_avg, exp_avg_sq (positive) of ``n`` elements."""
    gen = torch.Generator().manual_seed(seed)
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    return [p, g, m * 0.1, torch.rand(n, generator=gen) * 0.01]


def optax_f64(p, g, m, v, *, step, weight_decay, grad_mul=1.0) -> list[np.ndarray]:
    """optax ``adamw`` in float64 (reference/optim.py): the independent oracle."""
    p, g, m, v = (t.double().numpy() for t in (p, g, m, v))
    g = g * grad_mul
    m = ADAM["beta1"] * m + (1 - ADAM["beta1"]) * g
    v = ADAM["beta2"] * v + (1 - ADAM["beta2"]) * g * g
    m_hat, v_hat = m / (1 - ADAM["beta1"] ** step), v / (1 - ADAM["beta2"] ** step)
    p = p - LR * (m_hat / (np.sqrt(v_hat) + ADAM["eps"]) + weight_decay * p)
    return [p, m, v]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 5000), seed=st.integers(0, 2**16), weight_decay=st.sampled_from([0.0, 0.1]),
       step=st.sampled_from([1, 10_000]), compiled=st.booleans())
def test_one_pass_equals_adamw_within_fp32_rounding(n, seed, weight_decay, step, compiled):
    if compiled:
        compiled_kernel()
    p, g, m, v = state(n, seed)
    want = [t.clone() for t in (p, m, v)]
    oracle = optax_f64(p, g, m, v, step=step, weight_decay=weight_decay)
    adamw_(want[0], g, want[1], want[2], step=step, lr=LR, weight_decay=weight_decay, **ADAM)
    adamw_step_(p, g, m, v, step=step, lr=LR, weight_decay=weight_decay, compiled=compiled,
                **ADAM)
    for got, ref, exact in zip((p, m, v), want, oracle, strict=True):
        np.testing.assert_allclose(got.numpy(), ref.numpy(), **HOST_ADAMW)
        np.testing.assert_allclose(got.numpy(), exact, **HOST_ADAMW)
    if n:
        assert not torch.equal(p, state(n, seed)[0])  # it moved


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("step", [1, 10_000])
def test_compiled_kernel_and_torch_ops_agree_to_rounding(weight_decay, step):
    """Not bit for bit: torch's vectorised CPU ``sqrt`` is not correctly rounded (it differs
    from numpy's and the kernel's in ~1% of elements by an ulp)."""
    compiled_kernel()
    runs = []
    for compiled in (True, False):
        p, g, m, v = state(300_001, 1)
        out = torch.empty(p.numel(), dtype=torch.bfloat16)
        adamw_step_(p, g.bfloat16(), m, v, step=step, lr=LR, weight_decay=weight_decay,
                    grad_mul=0.37, out=out, compiled=compiled, **ADAM)
        runs.append((p, m, v, out))
    for a, b in zip(runs[0][:3], runs[1][:3], strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), **HOST_ADAMW)
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])
    assert torch.equal(runs[0][3], runs[0][0].bfloat16())


@pytest.mark.parametrize("compiled", [True, False])
def test_an_elements_result_does_not_depend_on_where_it_lies(compiled):
    """Each tier and stage slices the state differently (whole groups, shards, windows): the
    same element must come out the same at any offset, in a vector lane or in the tail."""
    if compiled:
        compiled_kernel()
    whole = state(4099, 2)
    want = [t.clone() for t in whole]
    adamw_step_(*want, step=3, lr=LR, weight_decay=0.1, grad_mul=0.5, compiled=compiled, **ADAM)
    for lo, hi in [(1, 4099), (3, 20), (5, 6), (7, 4096), (4090, 4099)]:
        piece = [t[lo:hi].clone() for t in whole]
        adamw_step_(*piece, step=3, lr=LR, weight_decay=0.1, grad_mul=0.5, compiled=compiled,
                    **ADAM)
        for got, ref in zip(piece, want, strict=True):
            assert torch.equal(got, ref[lo:hi]), (lo, hi)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compiled", [True, False])
def test_a_half_gradient_is_upcast_and_the_param_written_in_the_same_pass(dtype, compiled):
    if compiled:
        compiled_kernel()
    p, g, m, v = state(10_007, 3)
    g = g.to(dtype)
    want = [t.clone() for t in (p, m, v)]
    adamw_step_(want[0], g.float() * 0.25, want[1], want[2], step=2, lr=LR, weight_decay=0.1,
                compiled=compiled, **ADAM)
    out = g.clone()  # the gradient's own storage, as the sharded step's downcast target
    adamw_step_(p, out, m, v, step=2, lr=LR, weight_decay=0.1, grad_mul=0.25, out=out,
                compiled=compiled, **ADAM)
    for got, ref in zip((p, m, v), want, strict=True):
        assert torch.equal(got, ref)
    assert torch.equal(out, p.to(dtype))


def test_the_multiplier_is_the_unscale_times_the_clip():
    """``grad_mul`` applied in the pass equals the gradient multiplied beforehand (fp32)."""
    compiled_kernel()
    p, g, m, v = state(1000, 4)
    want = [t.clone() for t in (p, m, v)]
    adamw_step_(want[0], g * np.float32(1 / 1024 * 0.3), want[1], want[2], step=5, lr=LR,
                weight_decay=0.0, **ADAM)
    adamw_step_(p, g, m, v, step=5, lr=LR, weight_decay=0.0, grad_mul=1 / 1024 * 0.3, **ADAM)
    for got, ref in zip((p, m, v), want, strict=True):
        assert torch.equal(got, ref)


def test_overlapping_state_is_refused():
    compiled_kernel()
    buf = torch.zeros(20)
    with pytest.raises(ValueError, match="overlap"):
        adamw_step_(buf[:10], torch.ones(10), buf[5:15], torch.zeros(10), step=1, lr=LR,
                    weight_decay=0.0, **ADAM)


def test_the_kernel_lets_other_threads_run_while_it_steps():
    """The swap files' I/O threads must keep working while a window steps: the kernel runs
    without the GIL, so this thread counts many turns while another thread is in the kernel."""
    import threading
    import time

    compiled_kernel()
    p, g, m, v = state(1 << 24, 6)
    started = threading.Event()

    def steps():
        started.set()
        for _ in range(3):
            adamw_step_(p, g, m, v, step=1, lr=LR, weight_decay=0.0, **ADAM)

    worker = threading.Thread(target=steps)
    worker.start()
    started.wait()
    turns = 0
    while worker.is_alive():
        time.sleep(0.001)
        turns += 1
    worker.join()
    assert turns > 10, f"{turns} turns while the kernel ran: it holds the GIL"


@pytest.mark.spawns  # the compiler runs (in moezero): not beside the parallel pass' tests
def test_a_kernel_that_does_not_build_leaves_the_torch_ops_and_one_warning(tmp_path, caplog):
    """No compiler, no ninja or a failing build: ``load_compiled`` says why (logged once) and
    ``adamw_step_`` runs the same formula in torch ops."""
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with caplog.at_level("WARNING", logger="moezero.zero.hostadam"):
        module, why = load_compiled(broken)
        assert load_compiled(broken) == (None, why)  # cached: built and logged once
    assert module is None and why
    assert [r.getMessage() for r in caplog.records if "not available" in r.getMessage()] \
        == [f"the compiled AdamW kernel ({broken}) is not available, the step runs torch ops "
            f"(slower): {why}"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_square_sum_is_the_fp64_sum_of_fp32_squares_in_one_pass(dtype):
    """The global norm's terms: equal to float64 numpy's sum of the fp32 squares, non-finite
    elements counted; the same bits for a range with the partition's zero padding after it
    and for the upcast gradient (every tier sums its own range of the same values)."""
    compiled_kernel()
    from moezero.zero.hostadam import square_sum

    g = state(100_003, 7)[1].to(dtype)
    g[[5, 77_777]] = torch.tensor([float("inf"), float("nan")], dtype=dtype)
    sq, bad = square_sum(g)
    finite = g.float().numpy()[np.isfinite(g.float().numpy())]
    want = np.sum(np.square(finite, dtype=np.float32).astype(np.float64))
    assert bad == 2 and not np.isfinite(sq)
    g[[5, 77_777]] = 0
    sq, bad = square_sum(g)
    assert bad == 0 and sq == pytest.approx(want, rel=1e-12)
    padded = torch.cat([g, torch.zeros(13, dtype=dtype)])
    assert square_sum(padded) == (sq, 0) == square_sum(g.float())
