"""Distributed semantics: a real W = 2 gloo run of the torch engine (ep = 2, fp32, ZeRO
stage 0) equals the reference's single-process oracle of it.

``moezero.reference.model.oracle_loss(params, global_batch, cfg, world_size=2)`` routes each rank's
rows ``[r·b, (r+1)·b)`` on their own (capacity, aux and z per rank) and averages the two
losses. torch: each rank runs its slice, its experts serving both ranks' tokens through
``all_to_all``. Compared: the mean rank loss, the gradient of the global mean loss by FQN
(raw rank gradients reduced by the rule of docs/design.md, "Semantics": sum over the ranks holding a param / W),
the engine's global grad norm, and the params after one engine step vs
``moezero.reference.optim.train_step`` with ``world_size=2``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moezero.reference.optim import OptimConfig, TrainConfig, init_train_state, train_step
from parity_tests import ranks
from parity_tests.models import (
    BATCH,
    corpus_batch,
    engine_config,
    jit_oracle_and_grads,
    tiny,
    to_jax,
)
from parity_tests.tolerances import FP32
from tests.support.compare import assert_close_by_fqn, assert_rel, errors_by_fqn, jax_fqns
from tests.support.world import run_world

WORLD, EP = 2, 2
CONFIGS = {"dropless-k2": tiny(top_k=2), "capacity-k1": tiny(top_k=1, capacity_factor=1.0)}
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0, total_steps=10, gradient_clipping=1.0)
jit_train_step = jax.jit(train_step, static_argnums=0)


def reduce_like_engine(per_rank: list[dict]) -> dict:
    """Σ over the ranks holding a param, / W: dense params are averaged over all W ranks,
    each expert's gradient (held by one rank at ep = W) is divided by W."""
    out: dict[str, np.ndarray] = {}
    for grads in per_rank:
        for fqn, g in grads.items():
            out[fqn] = out.get(fqn, 0.0) + g / len(per_rank)
    return out


def merge_params(per_rank: list[dict]) -> dict:
    """Every rank's params by FQN; replicated ones must be equal on every rank."""
    out: dict[str, np.ndarray] = {}
    for params in per_rank:
        for fqn, p in params.items():
            assert fqn not in out or np.array_equal(out[fqn], p), f"{fqn} differs across ranks"
            out[fqn] = p
    return out


@pytest.fixture(scope="module")
def w2_runs(tmp_path_factory):
    """Both configs in one W = 2 world: ``{name: [rank 0 result, rank 1 result]}``."""
    batch = corpus_batch(0, batch=WORLD * BATCH)
    cfgs = [engine_config(c, OPTIM, ep_size=EP).model_dump(by_alias=True)
            for c in CONFIGS.values()]
    by_rank = run_world(ranks.each_config, WORLD, tmp_path_factory.mktemp("w2"), cfgs, batch)
    return batch, {name: [r[i] for r in by_rank] for i, name in enumerate(CONFIGS)}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, w2_runs):
    """(torch rank results, reference params, loss, grads) of one config."""
    batch, runs = w2_runs
    cfg, results = CONFIGS[request.param], runs[request.param]
    params = to_jax(merge_params([r["params_before"] for r in results]), cfg)
    (loss, _), grads = jit_oracle_and_grads(params, jnp.asarray(batch, jnp.int32), cfg, WORLD)
    return request.param, results, params, float(loss), jax_fqns(grads)


def test_experts_really_are_split(case):
    _, results, *_ = case
    experts = [{k for k in r["grads"] if ".experts." in k} for r in results]
    assert experts[0] and experts[1] and not experts[0] & experts[1]


def test_capacity_drops_on_every_rank(case):
    name, results, *_ = case
    assert all((r["dropped"] > 0) == name.startswith("capacity") for r in results)


def test_loss_equals_oracle(case):
    _, results, _, loss, _ = case
    assert_rel(np.mean([r["loss"] for r in results]), loss, FP32.loss_rel, "W=2 loss")


def test_grads_equal_oracle_grads(case):
    _, results, _, _, grads = case
    assert_close_by_fqn(reduce_like_engine([r["grads"] for r in results]), grads,
                        FP32.grad_rel, "W=2 grads")


def test_engine_grad_norm_is_the_oracle_norm(case):
    """The engine's reduction (scale included) gives the global gradient's norm."""
    _, results, _, _, grads = case
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values()))
    for r in results:
        assert_rel(r["grad_norm"], norm, FP32.train_loss_rel, "W=2 grad norm")


def test_params_after_one_step(case, w2_runs):
    name, results, params, *_ = case
    batch, _ = w2_runs
    tcfg = TrainConfig(model=CONFIGS[name], optim=OPTIM, world_size=WORLD)
    state, _ = jit_train_step(tcfg, init_train_state(tcfg, params), jnp.asarray(batch, jnp.int32))
    assert_close_by_fqn(merge_params([r["params_after"] for r in results]), jax_fqns(state.params),
                        FP32.train_param_rel, "W=2 params after one step")


def test_per_rank_routing_matters(case, w2_runs):
    """The check can fail: routing the global batch as one rank (world_size=1) gives router
    gradients (aux per rank) and, with capacity, expert gradients far outside tolerance."""
    name, results, params, *_ = case
    batch, _ = w2_runs
    _, grads_w1 = jit_oracle_and_grads(params, jnp.asarray(batch, jnp.int32), CONFIGS[name], 1)
    worst, fqn = errors_by_fqn(reduce_like_engine([r["grads"] for r in results]),
                               jax_fqns(grads_w1))[0]
    assert worst > 100 * FP32.grad_rel, (worst, fqn)
