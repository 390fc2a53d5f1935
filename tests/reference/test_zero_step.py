"""The sharded ZeRO step (``reference/zero.py``, shard_map on forced host devices) equals its
unsharded twin, step after step; the stacks follow the plan's partitions; fp16 overflow skips
the step on every device with ``LossScaler``'s scale update.

Tolerances (norm-wise relative by FQN, float64 arithmetic; measured over 4 topologies × 4
seeds × 10 steps, W ∈ {2, 4}, ep ∈ {1, 2, 4}, clipping on every step):

- ``REDUCED_RTOL`` = 1e-6 for what is linear in the reduced gradient: every step's loss, grad
  norm and clip coefficient, and exp_avg after step 1 (= (1 − β1)·clip·grad). Measured ≤ 3.5e-7:
  the sharded sum over ranks and the twin's autodiff of the mean differ in association only.
- ``STATE_RTOL`` = 1e-5 for params, exp_avg and exp_avg_sq after *each* step. 1e-6 cannot hold:
  AdamW's update of an element is ``lr·m̂/(√v̂ + eps)``, and the few gradient elements that are
  pure cancellation noise (|g| ≈ 1e-9 < eps = 1e-8, ~1% relative noise) turn an ulp of
  reassociation into ~1e-6 absolute in a tensor of norm ~0.5 at step 1. Measured worst 2.3e-6
  (params 1.7e-6; a twin built with ``vmap`` instead of a loop over ranks measured 8.7e-6 by the
  same mechanism). A real error (a wrong shard, a missing /W, a decayed norm gain) is ≥ 5e-4.
- fp16: the sharded step rounds the fp32 sum of the ranks' fp16 grads to fp16 (as torch does);
  the twin sums fp16 grads inside autodiff. Measured over 6 steps: grad norm and loss ≤ 1.3e-5
  (``FP16_REDUCED``), params ≤ 3.3e-4, exp_avg ≤ 9.4e-4, exp_avg_sq ≤ 1.5e-3 (``FP16_STATE``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moezero.plan import Partition
from moezero.reference.model import ModelConfig, init_params
from moezero.reference.optim import OptimConfig, TrainConfig, init_train_state, train_step
from moezero.reference.scaling import LossScaleConfig, init_loss_scale, update_loss_scale
from moezero.reference.weights import param_shapes, to_fqn_dict
from moezero.reference.zero import (
    adam_moments,
    init_twin_state,
    init_zero_state,
    twin_train_step,
    zero_train_step,
)
from moezero.reference.zero_layout import (
    ZeroConfig,
    fqn_views,
    group_buffer,
    make_mesh,
    master_params,
    plan_stacks,
    stack_fqns,
)

MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=48, num_experts=4,
                    top_k=2)
# grad norms are ~0.7-1.1 here: clipping at 0.5 acts on every step
OPTIM = OptimConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                    gradient_clipping=0.5, warmup_steps=2, total_steps=10)
ROWS, SEQ = 2, 16  # rows per rank, tokens per row
STEPS = 10
CAP = 999  # < one expert weight (48·32), odd: params sliced across groups, groups padded

REDUCED_RTOL = 1e-6
STATE_RTOL = 1e-5
FP16_REDUCED, FP16_STATE = 1e-4, 5e-3
STATIC = LossScaleConfig()
FP16 = LossScaleConfig(dynamic=True, initial_scale_power=8, window=2, hysteresis=2)

ZSTEP = jax.jit(zero_train_step, static_argnums=(0, 1))
TSTEP = jax.jit(twin_train_step, static_argnums=0)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def worst_by_fqn(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys()
    return max((rel(a[k], b[k]), k) for k in b)


class Step(NamedTuple):
    """One step of both sides, as numpy: metrics, and params / moments by FQN."""

    zero: dict
    twin: dict
    params: tuple[dict, dict]  # (sharded fp32 masters, twin params)
    mu: tuple[dict, dict]
    nu: tuple[dict, dict]
    replicated: dict  # the sharded state's all-gathered compute-dtype params
    raw: list  # every leaf of the sharded state (bitwise checks)


def _fqns(tree) -> dict:
    return {k: np.asarray(v, np.float64) for k, v in to_fqn_dict(tree).items()}


def zcfg(world, ep, cap=None, dtype="float32", scaling=STATIC) -> ZeroConfig:
    return ZeroConfig(model=MODEL, optim=OPTIM, world_size=world, ep_size=ep, dtype=dtype,
                      loss_scale=scaling, max_group_size=cap)


@functools.cache
def run(cfg: ZeroConfig, poison: tuple[int, ...] = (), steps: int = STEPS,
        seed: int = 0) -> list[Step]:
    """``steps`` steps of both sides on the same random batches; ``poison``: 1-based steps
    whose last rank's loss is multiplied by inf (an fp16 overflow on one rank only)."""
    mesh = make_mesh(cfg.world_size, cfg.ep_size)
    params = init_params(MODEL, jax.random.key(seed))
    zs, ts = init_zero_state(cfg, mesh, params), init_twin_state(cfg, params)
    twin_cfg = dataclasses.replace(cfg, ep_size=1, max_group_size=None)  # one compile per W
    rng = np.random.default_rng(seed)
    out = []
    for step in range(1, steps + 1):
        batch = jnp.asarray(rng.integers(0, MODEL.vocab_size, (ROWS * cfg.world_size, SEQ + 1)),
                            jnp.int32)
        mult = np.ones(cfg.world_size, np.float32)
        mult[-1] = np.inf if step in poison else 1.0
        zs, zm = ZSTEP(cfg, mesh, zs, batch, jnp.asarray(mult))
        ts, tm = TSTEP(twin_cfg, ts, batch, jnp.asarray(mult))
        (mz, nz), (mt, nt) = adam_moments(zs.opt_state), adam_moments(ts.opt_state)
        out.append(Step(jax.tree.map(np.asarray, zm), jax.tree.map(np.asarray, tm),
                        (stack_fqns(cfg, zs.master), _fqns(ts.params)),
                        (stack_fqns(cfg, mz), _fqns(mt)), (stack_fqns(cfg, nz), _fqns(nt)),
                        _fqns(zs.params),
                        [np.asarray(x) for x in jax.tree.leaves((zs.master, zs.opt_state))]))
    return out


# ------------------------------------------------------------------------------ the layout


@pytest.mark.parametrize("split_by_expert", [True, False])
@pytest.mark.parametrize("cap", [None, CAP])
def test_stacks_cover_every_element_once_in_plan_partitions(cap, split_by_expert):
    cfg = dataclasses.replace(zcfg(4, 2, cap), split_by_expert=split_by_expert)
    stacks = plan_stacks(cfg)
    seen = {fqn: np.zeros(int(np.prod(shape)), int) for fqn, shape in param_shapes(MODEL).items()}
    for stack in stacks:
        assert len(stack.groups) == (cfg.ep_size if stack.is_expert else 1)
        for j, (group, part) in enumerate(zip(stack.groups, stack.partitions, strict=True)):
            assert part.group == group.name and part.padded_numel == stack.padded_numel
            assert part.dp_size == cfg.world_size // (cfg.ep_size if stack.is_expert else 1)
            if stack.is_expert:
                assert group.ep_rank == j and group.user_group == stack.groups[0].user_group
            for member in group.members:
                seen[member.fqn][member.start:member.stop] += 1
    assert all((count == 1).all() for count in seen.values())
    if cap is not None:  # an odd cap: padded groups, params sliced across groups
        assert any(s.padded_numel > s.partitions[0].numel for s in stacks)
    assert any(s.is_expert for s in stacks) and any(not s.is_expert for s in stacks)


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (4, 2)])
def test_each_device_holds_its_partition_rank_range(world, ep):
    """Device (edp i, ep j) = rank i·ep + j holds ``Partition.rank_range`` of its DP rank."""
    cfg = zcfg(world, ep, CAP)
    mesh = make_mesh(world, ep)
    params = init_params(MODEL, jax.random.key(1))
    state = init_zero_state(cfg, mesh, params)
    views = fqn_views(params)
    rank_of = {d: i * ep + j for (i, j), d in np.ndenumerate(mesh.devices)}
    for stack in plan_stacks(cfg):
        for shard in state.master[stack.name].addressable_shards:
            rank = rank_of[shard.device]
            part: Partition = stack.partitions[rank % ep if stack.is_expert else 0]
            lo, hi = part.rank_range(part.dp_rank(rank))
            np.testing.assert_array_equal(shard.data, group_buffer(views, part, jnp.float32)[lo:hi])
    round_trip = master_params(cfg, state.master)
    jax.tree.map(np.testing.assert_array_equal, round_trip, params)


# ---------------------------------------------------------------------- sharded == twin


@pytest.mark.parametrize(("world", "ep", "cap"), [
    (2, 1, None), (2, 2, CAP), (4, 2, CAP),
    pytest.param(4, 4, None, marks=pytest.mark.slow)])
def test_sharded_step_equals_unsharded_twin_every_step(world, ep, cap):
    steps = run(zcfg(world, ep, cap))
    first = steps[0]
    assert np.any(first.mu[0]["lm_head.weight"] != 0)
    assert worst_by_fqn(*first.mu)[0] <= REDUCED_RTOL  # exp_avg = 0.1·clip·reduced grad
    for n, s in enumerate(steps, start=1):
        for key in ("loss", "grad_norm", "clip_coef"):
            assert rel(s.zero[key], s.twin[key]) <= REDUCED_RTOL, (n, key)
        assert s.zero["clip_coef"] < 1.0 and not s.zero["skipped"]  # clipping is active
        assert s.zero["lr"] == s.twin["lr"]
        for what in ("params", "mu", "nu"):
            err, fqn = worst_by_fqn(*getattr(s, what))
            assert err <= STATE_RTOL, f"step {n}: {what} {fqn} off by {err:.2e}"
        assert s.replicated.keys() == s.params[0].keys()
        for fqn, value in s.replicated.items():  # fp32: the gathered params are the masters
            np.testing.assert_array_equal(value, s.params[0][fqn])
    assert worst_by_fqn(steps[-1].params[0], _fqns(init_params(MODEL, jax.random.key(0))))[0] > 1e-3


def test_twin_equals_reference_optim_train_step():
    """The twin is ``moezero.reference.optim.train_step`` (oracle_loss + optax) when nothing scales."""
    cfg = zcfg(2, 1)
    tcfg = TrainConfig(model=MODEL, optim=OPTIM, world_size=2)
    params = init_params(MODEL, jax.random.key(0))
    twin, ref = init_twin_state(cfg, params), init_train_state(tcfg, params)
    rng = np.random.default_rng(5)
    for _ in range(3):
        batch = jnp.asarray(rng.integers(0, MODEL.vocab_size, (2 * ROWS, SEQ + 1)), jnp.int32)
        twin, tm = TSTEP(cfg, twin, batch, jnp.ones(2, jnp.float32))
        ref, rm = jax.jit(train_step, static_argnums=0)(tcfg, ref, batch)
        for key in ("loss", "grad_norm", "clip_coef", "lr"):
            assert rel(tm[key], rm[key]) <= REDUCED_RTOL, key
    assert worst_by_fqn(_fqns(twin.params), _fqns(ref.params))[0] <= STATE_RTOL


# ------------------------------------------------------------------------ fp16 loss scaling


class TorchLossScaler:
    """``moezero.zero.adamw.LossScaler.update`` transcribed (this suite never imports torch)."""

    def __init__(self, cfg: LossScaleConfig):
        self.cfg, self.scale = cfg, 2.0 ** cfg.initial_scale_power
        self.good, self.left = 0, cfg.hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self.good, self.left = 0, self.left - 1
            if self.left <= 0:
                self.scale, self.left = max(self.scale / 2, self.cfg.min_scale), self.cfg.hysteresis
            return
        self.good += 1
        if self.good % self.cfg.window == 0:
            self.scale, self.left = self.scale * 2, self.cfg.hysteresis


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_loss_scale_update_follows_loss_scaler(hysteresis):
    cfg = LossScaleConfig(dynamic=True, initial_scale_power=8, window=3, hysteresis=hysteresis,
                          min_scale=2.0 ** 5)
    # clean steps (the scale grows), a run of overflows (down to the minimum), then noise
    overflows = np.concatenate([np.zeros(7, bool), np.ones(18, bool),
                                np.random.default_rng(hysteresis).random(40) < 0.4])
    oracle, state, seen = TorchLossScaler(cfg), init_loss_scale(cfg), set()
    update = jax.jit(update_loss_scale, static_argnums=0)
    for overflow in overflows:
        oracle.update(bool(overflow))
        state = update(cfg, state, jnp.bool_(overflow))
        assert (float(state.scale), int(state.good_steps), int(state.hysteresis_left)) == (
            oracle.scale, oracle.good, oracle.left)
        seen.add(oracle.scale)
    assert cfg.min_scale in seen and max(seen) > 2.0 ** cfg.initial_scale_power  # both bounds


def test_static_scale_never_changes():
    cfg = LossScaleConfig()
    state = update_loss_scale(cfg, init_loss_scale(cfg), jnp.bool_(True))
    assert float(state.scale) == 1.0


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    """Overflow injected on the last rank only at steps 2 and 3 (hysteresis 2, window 2)."""
    steps = run(zcfg(2, 2, CAP, dtype="float16", scaling=FP16), poison=(2, 3), steps=6)
    oracle, scales = TorchLossScaler(FP16), []
    for s in steps:
        oracle.update(bool(s.zero["skipped"]))
        scales.append(oracle.scale)
    for side in ("zero", "twin"):
        assert [bool(getattr(s, side)["skipped"]) for s in steps] == [
            False, True, True, False, False, False]
        assert [float(getattr(s, side)["loss_scale"]) for s in steps] == scales
    assert scales == [256.0, 256.0, 128.0, 128.0, 256.0, 256.0]
    for before, skipped in ((steps[0], steps[1]), (steps[1], steps[2])):
        assert np.isinf(skipped.zero["grad_norm"]) and np.isinf(skipped.twin["grad_norm"])
        for a, b in zip(before.raw, skipped.raw, strict=True):  # every shard, every device
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(steps[2].raw[0], steps[3].raw[0])  # the next clean step steps
    for s in steps:
        for what in ("params", "mu", "nu"):
            assert worst_by_fqn(*getattr(s, what))[0] <= FP16_STATE, what
        if not s.zero["skipped"]:
            assert rel(s.zero["grad_norm"], s.twin["grad_norm"]) <= FP16_REDUCED
        assert rel(s.zero["loss"], s.twin["loss"]) <= FP16_REDUCED
        assert all(np.isfinite(v).all() for v in s.replicated.values())
