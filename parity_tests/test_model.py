"""Model parity: the whole decoder forward and backward, torch vs reference, same weights.

Weights are torch's ``init_weights``, moved to the reference by FQN. fp32: dropless and
capacity, k = 1 and 2, and every option of ``models.OPTIONS`` (GQA, head dim, QK-norm,
biases, router variants, expert bias, shared experts, dense first layers; norm gains, biases and expert biases
perturbed off their init): logits (max abs), loss (relative) and every gradient by FQN
(norm-wise). bf16: logits and grads within the bf16 tolerances.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from moezero.model.args import ModelArgs
from moezero.reference.model import ModelConfig
from parity_tests.models import (
    OPTIONS,
    REFERENCE_ONLY,
    engine_run,
    jax_run,
    perturb,
    tiny,
    to_jax,
    tokens,
    torch_model,
    torch_run,
)
from parity_tests.tolerances import BF16, FP32
from tests.support.compare import assert_close_by_fqn, assert_max_abs, assert_rel

CONFIGS = {
    "dropless-k1": tiny(top_k=1),
    "dropless-k2": tiny(top_k=2),
    "capacity-k1": tiny(top_k=1, capacity_factor=1.0),
    "capacity-k2": tiny(top_k=2, capacity_factor=1.0),
    **OPTIONS,
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def fp32_runs(request):
    """(torch run, reference run, tokens dropped by torch) of one config, computed once."""
    cfg = CONFIGS[request.param]
    model = torch_model(cfg, seed=1)
    if request.param in OPTIONS:
        perturb(model, seed=1)
    batch = tokens(3)
    ref = jax_run(to_jax(model, cfg), batch, cfg)
    mine = torch_run(model, batch)
    dropped = sum(int(layer.moe.last_stats["dropped"]) for layer in model.layers
                  if layer.mlp_kind.name == "moe")
    return mine, ref, dropped, cfg


def test_capacity_configs_drop_and_dropless_do_not(fp32_runs):
    *_, dropped, cfg = fp32_runs
    assert (dropped > 0) == (cfg.capacity_factor is not None)


def test_logits_fp32(fp32_runs):
    mine, ref, *_ = fp32_runs
    assert_max_abs(mine.logits, ref.logits, FP32.logits_abs, "fp32 logits")


def test_loss_fp32(fp32_runs):
    mine, ref, *_ = fp32_runs
    assert_rel(mine.loss, ref.loss, FP32.loss_rel, "fp32 loss")
    assert_rel(mine.ce, ref.ce, FP32.loss_rel, "fp32 ce")


def test_grads_fp32(fp32_runs):
    mine, ref, *_ = fp32_runs
    assert_close_by_fqn(mine.grads, ref.grads, FP32.grad_rel, "fp32 grads")


@pytest.mark.parametrize("name", [
    "dropless-k2",
    pytest.param("capacity-k1", marks=pytest.mark.slow),  # a bf16 compile costs ~10 s here
])
def test_bf16_logits_and_grads(name):
    """The engine at ``precision.dtype: bf16`` vs the reference at ``dtype=bf16`` (fp32
    masters cast to bf16 on entry; router, norms, softmax and loss in fp32 on both sides)."""
    cfg = CONFIGS[name]
    batch = tokens(3)
    params = to_jax(torch_model(cfg, seed=1), cfg)
    ref = jax_run(params, batch, cfg, jnp.bfloat16)
    mine = engine_run(cfg, batch, precision="bf16", seed=1)
    assert_max_abs(mine.logits, ref.logits, BF16.logits_abs, "bf16 logits")
    assert_rel(mine.loss, ref.loss, BF16.loss_rel, "bf16 loss")
    assert_close_by_fqn(mine.grads, ref.grads, BF16.grad_rel, "bf16 grads")


TORCH_ONLY = {"init_std", "ep_size", "expert_group_name", "loss_chunk_tokens"}
"""``ModelArgs`` fields the reference has no use for: its init is fixed, its experts are
stacked (no placement), its optimizer groups are the plan's, its logits are made whole (the
torch side's chunked loss equals them: tests/torch_impl/test_head.py)."""


def test_the_reference_config_has_every_model_setting_of_torch():
    """The reference keeps its own dataclass; its fields are ``ModelArgs``' (the config's)."""
    ref = {f.name for f in dataclasses.fields(ModelConfig)} - REFERENCE_ONLY
    assert ref == {f.name for f in dataclasses.fields(ModelArgs)} - TORCH_ONLY

