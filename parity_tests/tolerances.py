"""The parity suite's tolerances, in one place, per dtype (STYLE.md, Tests).

Both sides compute the same math (docs/model.md) in a different association order, so fp32
differences are rounding only: ~1e-7 relative per op, growing through depth and backward.
Measured worst errors (CPU, this suite's tiny configs; ``PARITY_REPORT=1 pytest parity_tests``
prints them) are in each comment. Tolerances sit ≥ 4x above them and below what a real
disagreement produces: a perturbed weight (``test_detects.py``), or a wrong convention, drop
order, tie rule, decay rule or schedule on one side (each checked once by mutating that side).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerances:
    op_rel: float  # max |a − b| / max |b| of one op (rmsnorm, rope, attention, router, MoE)
    loss_rel: float  # |a − b| / |b| of one forward's loss
    logits_abs: float  # max |a − b| of the model's logits
    grad_rel: float  # per-FQN ||a − b|| / ||b|| of one backward's gradients
    # Fraction of elements not bit-equal, for ops both sides compute in fp32 and round once to
    # this dtype (rmsnorm, rope). 1.0: not checked.
    op_unequal: float = 1.0
    train_loss_rel: float | None = None  # loss (and grad norm) of every step of an N-step run
    train_param_rel: float | None = None  # per-FQN ||a − b|| / ||b|| of params after N steps


FP32 = Tolerances(
    # One op in fp32, sums of ≤ 64 terms reordered: a few ulps (2^-23 ≈ 1.2e-7) of the
    # output's largest value; measured ≤ 1.8e-7.
    op_rel=1e-6,
    loss_rel=1e-5,  # losses, aux, z: measured ≤ 1.1e-7 (an ulp or two of ~4.2)
    logits_abs=1e-5,  # measured ≤ 2.4e-7 (logits are O(0.1-1))
    grad_rel=1e-4,  # measured ≤ 9.8e-7 (ops), ≤ 4.9e-7 (model), ≤ 4.0e-7 (W = 2)
    # Every step's loss (and grad norm) over 20 AdamW steps: measured ≤ 3.2e-7 (loss),
    # ≤ 6.1e-6 (grad norm).
    train_loss_rel=1e-4,
    # Adam maps every element's gradient to an O(lr) update whatever its size, so the large
    # relative rounding error of tiny gradient elements (an expert that saw few tokens)
    # becomes update noise: measured ≤ 1.2e-5 after 20 steps (and after W = 2's one step),
    # ≤ 1.3e-4 over a sweep of 55 seeds. A decayed norm gain, a bias correction or a schedule
    # off by a step moves the loss by ≥ 1e-3.
    train_param_rel=5e-4,
)

BF16 = Tolerances(
    # Two bf16 ulps (2^-8 each) of the largest value: both sides round the same fp32 math
    # once (rmsnorm, rope); measured 0 (bit-equal).
    op_rel=2**-7,
    # Both round the same fp32 value once: only a last-bit fp32 difference that lands on a
    # bf16 rounding boundary flips an element (~2^-16 each); measured 0. Computing in bf16
    # instead (the doc says fp32) flips ~37% of rmsnorm's elements.
    op_unequal=1e-2,
    loss_rel=1e-4,  # the fp32 CE of bf16 logits that differ by an ulp; measured ≤ 1.2e-5
    # |logits| < 0.5 at init, where one bf16 ulp is 2^-9 ≈ 2e-3: the sides round at different
    # points (SDPA vs einsum attention, fused vs unfused matmuls); measured 2.0e-3 (1 ulp).
    logits_abs=1e-2,
    # bf16 rounding noise through forward and backward is ~2^-8 relative per op; measured
    # ≤ 1.0e-2 (the same size as bf16 vs fp32 on either side, ~1.1e-2).
    grad_rel=4e-2,
    # No train_*: N-step parity runs in fp32 only (Adam's sign-like early updates turn bf16
    # gradient noise into parameter noise that says nothing about the semantics).
)

TOLERANCES = {"fp32": FP32, "bf16": BF16}

# The lr schedule, dtype-independent: the reference evaluates it in fp32 (cos of an fp32
# angle), torch in float64; measured ≤ 3.4e-7. One step off changes it by ≥ 1e-3.
SCHEDULE_REL = 1e-5
