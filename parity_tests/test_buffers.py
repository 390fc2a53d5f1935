"""Checkpointed buffers (the aux-loss-free expert bias) across the sides.

torch (W = 1, ZeRO stage 1) trains a sigmoid-routed model with expert biases and a shared
expert, saves, and keeps going; the reference loads the checkpoint with
``load_train_state`` (the biases from ``buffers.safetensors``, bit for bit) and continues with
``train_step``: the same losses and, at the end, the same biases. The other way: torch loads
the reference's ``save_train_state`` checkpoint, biases included, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.plan import store
from moezero.plan.model_buffers import is_buffer
from moezero.reference.checkpoint import load_train_state, save_train_state
from moezero.reference.optim import OptimConfig, TrainConfig, train_step
from moezero.reference.weights import to_fqn_dict
from parity_tests.models import corpus_batch, engine_config, tiny, torch_model
from parity_tests.tolerances import FP32
from tests.support.compare import assert_rel

MODEL = tiny(router_scoring="sigmoid", expert_bias=True, bias_update_rate=1e-2,
             shared_ffn_dim=24)
STEPS, SAVE_AT = 6, 3
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, gradient_clipping=1.0, warmup_steps=2,
                    total_steps=STEPS)
TRAIN = TrainConfig(model=MODEL, optim=OPTIM, world_size=1, dtype="float32")
jit_train_step = jax.jit(train_step, static_argnums=0)


def torch_engine():
    cfg = engine_config(MODEL, OPTIM, stage=1)
    return initialize(torch_model(MODEL, seed=4), cfg,
                      topology=build_topology([1], num_experts=MODEL.num_experts), device="cpu")


def torch_buffers(engine) -> dict[str, np.ndarray]:
    return {k: b.numpy().copy() for k, b in engine.model.named_buffers() if is_buffer(k)}


def ref_buffers(params) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in to_fqn_dict(params).items() if is_buffer(k)}


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    engine, losses, at_save = torch_engine(), [], None
    for step in range(STEPS):
        losses.append(engine.train_step([torch.from_numpy(corpus_batch(step, batch=4))])["loss"])
        if step + 1 == SAVE_AT:
            engine.save_checkpoint(root)
            at_save = torch_buffers(engine)
    return root / f"step_{SAVE_AT:08d}", losses, at_save, torch_buffers(engine)


def test_reference_loads_torch_biases_and_continues_alike(torch_run):
    ckpt, losses, at_save, at_end = torch_run
    assert len(store.read_manifest(ckpt).layout.buffers) == MODEL.n_layers
    state, _ = load_train_state(ckpt, TRAIN)
    loaded = ref_buffers(state.params)
    assert loaded.keys() == at_save.keys() and any(v.any() for v in loaded.values())
    for k, v in at_save.items():
        np.testing.assert_array_equal(loaded[k], v, err_msg=k)
    for step in range(SAVE_AT, STEPS):
        state, metrics = jit_train_step(TRAIN, state, jnp.asarray(corpus_batch(step, batch=4)))
        assert_rel(losses[step], float(metrics["loss"]), FP32.train_loss_rel,
                   f"continued loss, step {step + 1}")
    for k, v in ref_buffers(state.params).items():
        np.testing.assert_array_equal(at_end[k], v, err_msg=k)


def test_torch_loads_reference_biases(torch_run, tmp_path):
    ckpt, *_ = torch_run
    state, _ = load_train_state(ckpt, TRAIN)
    state, _ = jit_train_step(TRAIN, state, jnp.asarray(corpus_batch(SAVE_AT, batch=4)))
    saved = save_train_state(tmp_path, TRAIN, state, max_group_size=999)
    assert (saved / "buffers.safetensors").is_file() and store.verify(saved) == []
    engine = torch_engine()
    engine.load_checkpoint(saved)
    mine, theirs = torch_buffers(engine), ref_buffers(state.params)
    assert mine.keys() == theirs.keys()
    for k, v in theirs.items():
        np.testing.assert_array_equal(mine[k], v, err_msg=k)
