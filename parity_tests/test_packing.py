"""Packed-row parity: torch vs reference with document masks and loss masks, same weights.

Document masks (``model(tokens, documents)`` ↔ ``forward(..., documents_BS=)``): logits.
Loss masks (``Decoder.loss(loss_mask_BS=, divisor=)`` ↔ ``loss_fn``): the loss, the ce and
every gradient by FQN, with the local count as divisor and with a given (global) divisor.
The engine's masked step over two micro-batches (the global count divides both) ↔
``masked_oracle_loss`` at W = 2: the loss and the gradient of the global masked mean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from moezero.distributed.topology import build_topology
from moezero.engine import initialize, loss_divisor
from moezero.model.packing import Batch
from moezero.plan.model_buffers import is_buffer
from moezero.reference.model import forward, loss_fn, masked_oracle_loss
from moezero.reference.optim import OptimConfig
from parity_tests.models import OPTIONS, SEQ, engine_config, tiny, to_jax, tokens, torch_model
from parity_tests.tolerances import FP32
from tests.support.compare import (
    assert_close_by_fqn,
    assert_max_abs,
    assert_rel,
    jax_fqns,
    to_numpy,
    torch_fqns,
)

CONFIGS = {"gqa-dropless": tiny(n_heads=4, n_kv_heads=2, qk_norm="head"),
           "capacity-k2": tiny(capacity_factor=1.0),
           "gpt-oss": OPTIONS["gpt-oss"]}  # sinks and windows within documents


def packed(seed: int):
    """Tokens [2, SEQ+1], a loss mask [2, SEQ] and document labels [2, SEQ] (3 and 2 docs)."""
    rng = np.random.default_rng(seed)
    mask = rng.random((2, SEQ)) < 0.6
    docs = np.stack([np.repeat([0, 1, 2], [5, 7, SEQ - 12]), np.repeat([4, 9], [3, SEQ - 3])])
    return tokens(seed), mask, docs


def _ref_loss_grads(params, batch, mask, docs, cfg, divisor):
    def loss(p):
        return loss_fn(p, batch, cfg, loss_mask_BS=mask, documents_BS=docs, divisor=divisor)
    (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
    logits, _ = forward(params, batch[:, :-1], cfg, documents_BS=docs)
    return value, metrics["ce"], grads, logits


jit_ref = jax.jit(_ref_loss_grads, static_argnames=("cfg", "divisor"))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("divisor", [None, 7.5])
def test_masked_packed_loss_logits_and_grads(name, divisor):
    cfg = CONFIGS[name]
    model = torch_model(cfg, seed=1)
    batch, mask, docs = packed(5)
    value, ce, grads, logits = jit_ref(to_jax(model, cfg), jnp.asarray(batch, jnp.int32),
                                       jnp.asarray(mask), jnp.asarray(docs), cfg, divisor)
    loss, parts = model.loss(torch.as_tensor(batch), loss_mask_BS=torch.as_tensor(mask),
                             documents_BS=torch.as_tensor(docs), divisor=divisor)
    loss.backward()
    with torch.no_grad():
        mine, _ = model(torch.as_tensor(batch)[:, :-1], torch.as_tensor(docs))
    assert_max_abs(to_numpy(mine), to_numpy(logits), FP32.logits_abs, "packed logits")
    assert_rel(loss.item(), float(value), FP32.loss_rel, "masked loss")
    assert_rel(parts["ce"].item(), float(ce), FP32.loss_rel, "masked ce")
    ref_grads = {k: v for k, v in jax_fqns(grads).items() if not is_buffer(k)}
    assert_close_by_fqn(torch_fqns(model, grads=True), ref_grads, FP32.grad_rel, "grads")


def _oracle(params, batch, mask, docs, cfg, world):
    return jax.value_and_grad(masked_oracle_loss, has_aux=True)(params, batch, mask, docs, cfg,
                                                                world)


jit_oracle = jax.jit(_oracle, static_argnames=("cfg", "world"))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_masked_step_equals_the_reference_oracle(name):
    cfg = CONFIGS[name]
    parts = [packed(5), packed(6)]  # two micro-batches whose trained counts differ
    batch, mask, docs = (np.concatenate([p[i] for p in parts]) for i in range(3))
    assert parts[0][1].sum() != parts[1][1].sum()
    model = torch_model(cfg, seed=1)
    params = to_jax(model, cfg)
    config = engine_config(cfg, OptimConfig())
    config.train.grad_accum_steps = 2
    engine = initialize(model, config, topology=build_topology([1], num_experts=cfg.num_experts),
                        device="cpu")
    micro = [Batch.of(p) for p in parts]
    divisor = loss_divisor(micro, engine.topology, engine.device)
    losses = []
    for b in micro:
        loss, _ = engine.forward(b, divisor)
        engine.backward(loss)
        losses.append(loss.item())
    engine.reduce_gradients()
    (value, _), grads = jit_oracle(params, jnp.asarray(batch, jnp.int32), jnp.asarray(mask),
                                   jnp.asarray(docs), cfg, 2)
    assert_rel(sum(losses) / 2, float(value), FP32.loss_rel, "masked oracle loss")
    ref_grads = {k: v for k, v in jax_fqns(grads).items() if not is_buffer(k)}
    assert_close_by_fqn(torch_fqns(engine.gradients()), ref_grads, FP32.grad_rel, "grads")
