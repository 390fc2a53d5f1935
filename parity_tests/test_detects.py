"""The suite can fail: a small real disagreement breaks the model tier's tolerances.

One side only gets a perturbed expert weight (fp32: one element +0.01, half the init std;
bf16: that expert's whole w1 ×1.1). The unperturbed pair passes (test_model.py); the perturbed
one must fail the logits or the gradient check, with the perturbed expert among the worst
FQNs. The per-rank semantics check lives in test_distributed.py
(``test_per_rank_routing_matters``); the ZeRO step's in test_zero_parity.py
(``test_isolated_step_detects_bugs``: a missing clip, a wrong /W, a shard one rank off).
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import torch

from parity_tests.models import TINY, jax_run, to_jax, tokens, torch_model, torch_run
from parity_tests.tolerances import TOLERANCES
from tests.support.compare import errors_by_fqn, max_abs, torch_fqns

FQN = "layers.1.moe.experts.2.w1.weight"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_perturbed_expert_fails_the_model_tier(dtype):
    batch = tokens(3)
    model = torch_model(TINY, seed=1)
    flat = torch_fqns(model)
    flat[FQN] = flat[FQN].copy()
    if dtype == "fp32":
        flat[FQN][0, 0] += 0.01
        mine, ref = torch_run(model, batch), jax_run(to_jax(flat, TINY), batch, TINY)
    else:
        flat[FQN] *= 1.1
        mine = torch_run(model.to(torch.bfloat16), batch)
        ref = jax_run(to_jax(flat, TINY), batch, TINY, jnp.bfloat16)
    tol = TOLERANCES[dtype]
    worst = errors_by_fqn(mine.grads, ref.grads)
    assert worst[0][0] > tol.grad_rel, worst[:3]
    assert any(fqn.startswith("layers.1.moe.experts.2.") for _, fqn in worst[:3]), worst[:3]
    if dtype == "fp32":
        assert max_abs(mine.logits, ref.logits) > tol.logits_abs
