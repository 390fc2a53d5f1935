"""LoRA against the reference (``moezero.model.lora`` vs ``reference/model.py: linear`` and
``reference/moe.py: apply_experts`` with ``ModelConfig.lora_*``): adapters on attention, the
shared expert and the routed experts (torch runs them as grouped GEMMs). One forward/backward
with non-zero adapters: the same loss, logits and gradients by FQN; then 10 AdamW steps with
the base frozen on both sides (``plan.freeze.freeze_patterns``): the same losses and grad
norms every step and the same adapters at the end, the base unchanged.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.plan.freeze import freeze_patterns
from moezero.reference.optim import OptimConfig, TrainConfig, init_train_state
from parity_tests.models import (
    engine_config,
    jax_run,
    tiny,
    to_jax,
    tokens,
    torch_model,
    torch_run,
    train_both,
)
from parity_tests.tolerances import FP32
from tests.support.compare import (
    assert_close_by_fqn,
    assert_max_abs,
    assert_rel,
    jax_fqns,
    torch_fqns,
)

CFG = tiny(top_k=2, shared_ffn_dim=24, lora_r=4, lora_scale=2.0,
           lora_targets=("attn", "shared", "experts"))
STEPS = 10


def lora_model(seed: int = 2):
    """The torch model with every ``lora_B`` drawn at random (a fresh one is zero)."""
    model = torch_model(CFG, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            if fqn.endswith(".lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_adapters_everywhere_forward_and_backward():
    model = lora_model()
    names = [n for n, _ in model.named_parameters() if ".lora_" in n]
    assert any(".experts.3.w2.lora_B" in n for n in names) and any(".shared." in n for n in names)
    batch = tokens(5)
    mine = torch_run(model, batch)
    ref = jax_run(to_jax(model, CFG), batch, CFG)
    assert_rel(mine.loss, ref.loss, FP32.loss_rel, "lora loss")
    assert_max_abs(mine.logits, ref.logits, FP32.logits_abs, "lora logits")
    assert_close_by_fqn(mine.grads, ref.grads, FP32.grad_rel, "lora grads")
    plain = dataclasses.replace(CFG, lora_r=0, lora_targets=())
    base = jax_run(to_jax(torch_model(plain, seed=2), plain), batch, plain)
    assert abs(float(ref.loss) - float(base.loss)) > 1e-4  # the adapters do act


@pytest.fixture(scope="module")
def trained():
    opt = OptimConfig(lr=1e-2, weight_decay=0.1, gradient_clipping=1.0, warmup_steps=2,
                      total_steps=STEPS)
    model = lora_model()
    initial = {k: v.copy() for k, v in torch_fqns(dict(model.named_parameters())).items()}
    state = init_train_state(TrainConfig(model=CFG, optim=opt), to_jax(model, CFG))
    engine = initialize(model, engine_config(CFG, opt),
                        topology=build_topology([1], num_experts=CFG.num_experts), device="cpu")
    tcfg = TrainConfig(model=CFG, optim=opt, freeze=tuple(freeze_patterns([], lora=True)))
    state, mine, ref = train_both(engine, tcfg, state, STEPS)
    return initial, mine, ref, torch_fqns(engine.params), jax_fqns(state.params)


def test_lora_training_losses_and_grad_norms(trained):
    _, mine, ref, *_ = trained
    for i, (m, r) in enumerate(zip(mine, ref, strict=True), start=1):
        assert_rel(m["loss"], r["loss"], FP32.train_loss_rel, f"lora: loss, step {i}")
        assert_rel(m["grad_norm"], r["grad_norm"], FP32.train_loss_rel, f"lora: norm, step {i}")


def test_lora_training_moves_the_adapters_only(trained):
    initial, _, _, mine, ref = trained
    ref = {k: v for k, v in ref.items() if k in mine}
    assert_close_by_fqn(mine, ref, FP32.train_param_rel, f"lora: params after {STEPS} steps")
    for fqn, value in initial.items():
        moved = not np.array_equal(mine[fqn], value)
        assert moved == (".lora_" in fqn), fqn
        assert np.array_equal(ref[fqn], value) == (not moved), fqn
