"""ZeRO parity: the torch engine (stages 1 and 2, real gloo ranks) vs the reference sharded step
(``reference/zero.py``) and its unsharded twin, by FQN, after each of 10 steps.

torch: ``run_world`` spawns W gloo ranks; each builds the model with ``train.build_model``,
``engine.initialize`` with a ``Config`` (``zero_optimization.stage`` 1 or 2, ``moe.ep_size``,
``moe.max_group_size``), reads its rows ``[r·b, (r+1)·b)`` of each global batch through
``torch_impl.data.Batches`` and runs forward → backward → ``reduce_gradients`` →
``optimizer_step``; after every step it returns its parameters and its partitions of the fp32
master, exp_avg and exp_avg_sq (``ZeroOptimizer.state_pieces``). The parent merges the ranks
(every element owned exactly once; replicas bit-equal) and moves the initial weights to JAX by
FQN. JAX: ``zero_train_step`` on a (W/ep, ep) mesh of forced host devices and
``twin_train_step`` on the same global batches (``split_batch`` gives rank r the same rows).

Compared after every step: master weights, exp_avg and exp_avg_sq by FQN (torch vs sharded,
torch vs twin), the global grad norm, lr, loss scale and skip flag; and once: both sides'
optimizer groups and partitions (the same plan). Tolerances and measured errors: ``TOL`` below.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from parity_tests.compare import errors_by_fqn, rel_err
from parity_tests.models import SEQ, engine_config, tiny
from reference.optim import OptimConfig
from reference.plan import plan_groups, plan_partitions
from reference.weights import from_fqn_dict, to_fqn_dict
from reference.zero import (
    LossScaleConfig,
    ZeroConfig,
    adam_moments,
    init_loss_scale,
    init_twin_state,
    init_zero_state,
    make_mesh,
    param_specs,
    stack_fqns,
    twin_train_step,
    update_loss_scale,
    user_groups,
    zero_train_step,
)
from tests.torch_impl.distributed import run_world
from torch_impl.config import Config
from torch_impl.data import Batches, make_corpus
from torch_impl.engine import initialize
from torch_impl.optim import LossScaler
from torch_impl.parallel import build_topology
from torch_impl.train import build_model

MODEL = tiny(n_layers=1)  # dim 32, 2 heads, ffn 48, 4 experts, top-2, vocab 64
ROWS = 2  # rows per rank
STEPS = 10
CAP = 999  # moe.max_group_size: odd and < one expert weight: sliced params, padded groups
CLIP = 0.5  # grad norms here are 0.75-1.6: clipping acts on every step
FP16_POWER, FP16_WINDOW, FP16_HYSTERESIS = 8, 3, 2
POISON = (2, 3)  # fp16 runs: 1-based steps whose last rank's loss is multiplied by inf


@dataclasses.dataclass(frozen=True)
class Tol:
    """Norm-wise relative errors (float64 arithmetic), torch vs each JAX side, per precision.

    ``reduced``: what is linear in the reduced gradient: every step's loss and grad norm, and
    exp_avg after step 1 (= (1 − β1)·clip·grad). ``master``: fp32 masters (and the gathered
    compute params) by FQN after every step. ``moments``: exp_avg and exp_avg_sq by FQN after
    every step; ``None``: compared after step 1 only (see below).
    """

    reduced: float
    master: float
    moments: float | None


TOL = {
    # Measured worst over 10 steps of W=2 ep 1/2 and W=4 ep 2, stages 1 and 2: loss 2.1e-7,
    # grad norm 3.0e-7, step-1 exp_avg 3.7e-7; masters 1.3e-6, moments 4.9e-6. 1e-6 cannot hold
    # for the state: AdamW's step-1 update ``lr·g/(|g| + eps)`` of the few gradient elements
    # that are pure cancellation noise (|g| ≲ eps = 1e-8) turns an ulp of reassociation into
    # ~1e-6 absolute in a param of norm ~0.5, and later steps carry it on (the JAX-only seed
    # sweep of tests/reference/test_zero_step.py: ≤ 2.3e-6; 8.7e-6 with a vmap'd twin). The
    # tolerance leaves ~4x headroom for other CPUs' kernel blockings; a wrong shard, a missing /W
    # or a decayed norm gain is ≥ 5e-4.
    "fp32": Tol(reduced=1e-6, master=2e-5, moments=2e-5),
    # fp16: each side rounds the same math differently (torch fp16 kernels vs XLA), ~5e-4 per
    # op: step-1 exp_avg 8.3e-4; a step-1 update that flips sign on a noise-level gradient
    # element moves a param by 2·lr·|update| (one element: 1.2e-2 of the tensor), and near-tied
    # top-2 routing decisions flip after that, so one expert's gradient differs by O(1/tokens)
    # and the moments decorrelate (exp_avg 0.46 by step 10): moments are compared after step 1
    # only; masters measured ≤ 0.12, grad norm ≤ 1.2e-2, loss ≤ 2.3e-4. The fp16 run is about
    # loss scaling: skips, scales and the untouched state are compared exactly.
    "fp16": Tol(reduced=3e-2, master=0.3, moments=None),
    # bf16 (8-bit mantissa): step-1 exp_avg 6.9e-3, grad norm ≤ 4.6e-2, loss ≤ 6.3e-4,
    # masters ≤ 0.18, moments decorrelate by step 6 (as fp16).
    "bf16": Tol(reduced=0.1, master=0.4, moments=None),
}


def optim(clip: float | None) -> OptimConfig:
    return OptimConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                       gradient_clipping=clip, warmup_steps=3, min_lr_ratio=0.1,
                       total_steps=STEPS)


@dataclasses.dataclass(frozen=True)
class Case:
    world: int
    ep: int
    precision: str = "fp32"
    stages: tuple[int, ...] = (1, 2)
    poison: tuple[int, ...] = ()

    def torch_config(self, stage: int) -> dict:
        cfg = engine_config(MODEL, optim(CLIP), precision=self.precision, ep_size=self.ep,
                            stage=stage)
        cfg.moe.max_group_size = CAP
        cfg.zero_optimization.reduce_bucket_size = 3000  # several buckets, split groups
        cfg.precision = cfg.precision.model_copy(update={
            "initial_scale_power": FP16_POWER, "loss_scale_window": FP16_WINDOW,
            "hysteresis": FP16_HYSTERESIS})
        return Config.model_validate(cfg.model_dump(by_alias=True)).model_dump(by_alias=True)

    def zero_config(self) -> ZeroConfig:
        dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[self.precision]
        scaling = LossScaleConfig(dynamic=self.precision == "fp16",
                                  initial_scale_power=FP16_POWER, window=FP16_WINDOW,
                                  hysteresis=FP16_HYSTERESIS)
        return ZeroConfig(model=MODEL, optim=optim(CLIP), world_size=self.world, ep_size=self.ep,
                          dtype=dtype, loss_scale=scaling, max_group_size=CAP)


CASES = {
    "w2_ep1": Case(2, 1),
    "w2_ep2": Case(2, 2),
    "w2_ep2_fp16": Case(2, 2, "fp16", stages=(2,), poison=POISON),
    "w4_ep2": Case(4, 2),
    "w2_ep2_bf16": Case(2, 2, "bf16", stages=(2,)),
}
FAST = ("w2_ep1", "w2_ep2", "w2_ep2_fp16")  # one W=2 world; the others are slow, one each


# ---------------------------------------------------------------------------- torch ranks


def torch_run(cfg_data: dict, world_of_batch: int, poison: tuple[int, ...]) -> dict:
    """This rank's view of STEPS engine steps: params and state partitions after each."""
    cfg = Config.model_validate(cfg_data)
    topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
    data = Batches(make_corpus(None, vocab=cfg.data.synthetic_vocab, sources=2, seed=7),
                   global_batch=ROWS * world_of_batch, seq_len=cfg.train.seq_len, seed=0,
                   dp_rank=topo.rank, dp_size=topo.world_size)
    groups = engine.groups
    out = {"rank": topo.rank, "plan": groups.plan, "partitions": groups.partitions,
           "user_groups": groups.user_groups, "initial": _params(engine), "steps": []}
    for step in range(1, STEPS + 1):
        loss, _ = engine.forward(torch.from_numpy(data.next()))
        bad = step in poison and topo.rank == topo.world_size - 1
        engine.backward(loss * float("inf") if bad else loss)
        engine.reduce_gradients()
        metrics = engine.optimizer_step()
        pieces = [(piece.fqn, piece.start, piece.stop,
                   *(views[k].clone().numpy() for k in ("master", "exp_avg", "exp_avg_sq")))
                  for piece, views in engine.zero.state_pieces()]
        out["steps"].append({"metrics": metrics, "loss": loss.item(), "pieces": pieces,
                             "params": _params(engine)})
    return out


def _params(engine) -> dict:
    return {k: p.detach().float().clone().numpy() for k, p in engine.params.items()}


def torch_cases(names: tuple[str, ...]) -> dict:
    """Every (case, stage) of ``names`` in this world, in order (spawning is the slow part)."""
    return {(name, stage): torch_run(CASES[name].torch_config(stage), CASES[name].world,
                                     CASES[name].poison)
            for name in names for stage in CASES[name].stages}


def merge_params(ranks: list[dict]) -> dict:
    """One dict of every FQN; a param held by several ranks must be bit-equal on all."""
    out = {}
    for params in ranks:
        for fqn, value in params.items():
            if fqn in out:
                np.testing.assert_array_equal(out[fqn], value, err_msg=fqn)
            out[fqn] = value
    return out


def merge_pieces(ranks: list[list], shapes: dict) -> tuple[dict, dict, dict]:
    """(master, exp_avg, exp_avg_sq) by FQN from every rank's partitions, each element once."""
    full = [{k: np.zeros(int(np.prod(s))) for k, s in shapes.items()} for _ in range(3)]
    count = {k: np.zeros(int(np.prod(s)), int) for k, s in shapes.items()}
    for pieces in ranks:
        for fqn, start, stop, *values in pieces:
            for dest, value in zip(full, values, strict=True):
                dest[fqn][start:stop] = value
            count[fqn][start:stop] += 1
    bad = [k for k, c in count.items() if not (c == 1).all()]
    assert not bad, f"partitions do not cover these params exactly once: {bad[:3]}"
    return tuple({k: v.reshape(shapes[k]) for k, v in d.items()} for d in full)


# ---------------------------------------------------------------------------------- JAX


ZSTEP = jax.jit(zero_train_step, static_argnums=(0, 1))
TSTEP = jax.jit(twin_train_step, static_argnums=0)


def _np(tree) -> dict:
    return {k: np.asarray(v, np.float64) for k, v in to_fqn_dict(tree).items()}


def jax_run(case: Case, initial: dict) -> list[dict]:
    """STEPS steps of the sharded step and of its twin from the torch initial weights."""
    cfg = case.zero_config()
    twin_cfg = dataclasses.replace(cfg, ep_size=1, max_group_size=None)  # one compile per W
    mesh = make_mesh(case.world, case.ep)
    params = from_fqn_dict({k: np.asarray(v, np.float32) for k, v in initial.items()}, MODEL)
    zs, ts = init_zero_state(cfg, mesh, params), init_twin_state(twin_cfg, params)
    data = Batches(make_corpus(None, vocab=32, sources=2, seed=7), global_batch=ROWS * case.world,
                   seq_len=SEQ, seed=0, dp_rank=0, dp_size=1)
    out = []
    for step in range(1, STEPS + 1):
        batch = jnp.asarray(data.global_batch_at(step - 1), jnp.int32)
        mult = np.ones(case.world, np.float32)
        mult[-1] = np.inf if step in case.poison else 1.0
        zs, zm = ZSTEP(cfg, mesh, zs, batch, jnp.asarray(mult))
        ts, tm = TSTEP(twin_cfg, ts, batch, jnp.asarray(mult))
        (mz, nz), (mt, nt) = adam_moments(zs.opt_state), adam_moments(ts.opt_state)
        out.append({
            "zero": {k: float(v) for k, v in zm.items()}, "twin": {k: float(v) for k, v in tm.items()},
            "zero_state": (stack_fqns(cfg, zs.master), stack_fqns(cfg, mz), stack_fqns(cfg, nz)),
            "twin_state": (_np(ts.params), _np(mt), _np(nt)), "zero_params": _np(zs.params)})
    return out


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``get(name, stage)`` -> (torch ranks' results, JAX steps); each world and JAX run once."""
    worlds, jax_runs = {}, {}

    def get(name: str, stage: int) -> tuple[list[dict], list[dict]]:
        names = FAST if name in FAST else (name,)
        if names not in worlds:
            worlds[names] = run_world(torch_cases, CASES[name].world,
                                      tmp_path_factory.mktemp("zero"), names, timeout_s=300)
        runs = [r[(name, stage)] for r in worlds[names]]
        initial = merge_params([r["initial"] for r in runs])
        if name not in jax_runs:  # the same for every stage: the torch init is keyed by FQN
            jax_runs[name] = (initial, jax_run(CASES[name], initial))
        for fqn, value in jax_runs[name][0].items():
            np.testing.assert_array_equal(initial[fqn], value)
        return runs, jax_runs[name][1]

    return get


def _case(name: str, stage: int):
    marks = () if name in FAST else (pytest.mark.slow,)
    return pytest.param(name, stage, marks=marks, id=f"{name}-stage{stage}")


CASE_STAGES = [_case(n, s) for n, c in CASES.items() for s in c.stages]


def step_errors(runs: list[dict], steps: list[dict], n: int) -> dict[str, tuple[float, str]]:
    """Worst (relative error, FQN) at step ``n`` (0-based) of each compared pair of states."""
    shapes = {k: v.shape for k, v in steps[n]["twin_state"][0].items()}
    torch_state = merge_pieces([r["steps"][n]["pieces"] for r in runs], shapes)
    out = {}
    for i, what in enumerate(("master", "exp_avg", "exp_avg_sq")):
        for other in ("zero", "twin"):
            out[f"{what}/torch-{other}"] = errors_by_fqn(torch_state[i],
                                                         steps[n][f"{other}_state"][i])[0]
    params = merge_params([r["steps"][n]["params"] for r in runs])  # compute dtype, gathered
    out["params/torch-zero"] = errors_by_fqn(params, steps[n]["zero_params"])[0]
    return out


# --------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("name", "stage"), CASE_STAGES)
def test_both_sides_plan_the_same_groups_and_partitions(results, name, stage):
    runs, _ = results(name, stage)
    cfg = CASES[name].zero_config()
    groups = plan_groups(param_specs(cfg), max_group_size=CAP)
    for run in runs:
        assert run["plan"] == groups
        assert run["partitions"] == plan_partitions(groups, world_size=CASES[name].world)
        assert set(run["user_groups"]) == set(user_groups(cfg))  # same weight decay rules
    assert any(len(g.members) > 1 for g in groups) and any(
        p.padded_numel > p.numel for p in runs[0]["partitions"])


def _limit(tol: Tol, what: str, n: int) -> float | None:
    """The tolerance of state ``what`` after step ``n`` (0-based); None: not compared."""
    if what in ("master", "params"):
        return tol.master
    if n == 0 and what == "exp_avg":  # (1 − β1)·clip·reduced gradient
        return tol.reduced
    return tol.moments


@pytest.mark.parametrize(("name", "stage"), CASE_STAGES)
def test_state_by_fqn_after_every_step(results, name, stage):
    """fp32 master, exp_avg and exp_avg_sq: torch vs the sharded step and vs the twin."""
    runs, steps = results(name, stage)
    tol = TOL[CASES[name].precision]
    for n in range(STEPS):
        for pair, (err, fqn) in step_errors(runs, steps, n).items():
            limit = _limit(tol, pair.split("/")[0], n)
            if limit is not None:
                assert err <= limit, f"step {n + 1}: {pair} {fqn} off by {err:.2e} (tol {limit})"
    first, last = steps[0]["twin_state"][0], steps[-1]["twin_state"][0]
    assert max(rel_err(last[k], first[k]) for k in first) > 1e-3  # it trained


@pytest.mark.parametrize(("name", "stage"), CASE_STAGES)
def test_grad_norm_lr_loss_scale_and_skips_every_step(results, name, stage):
    runs, steps = results(name, stage)
    case = CASES[name]
    tol = TOL[case.precision].reduced
    for n, jax_step in enumerate(steps):
        for run in runs:  # every rank reports the same
            mine = run["steps"][n]["metrics"]
            assert mine["skipped"] == (n + 1 in case.poison)
            for other in ("zero", "twin"):
                theirs = jax_step[other]
                assert bool(theirs["skipped"]) == mine["skipped"]
                assert theirs["loss_scale"] == mine["loss_scale"]
                assert rel_err(theirs["lr"], mine["lr"]) <= 1e-6  # fp32 vs float64 schedule
                if mine["skipped"]:
                    assert np.isinf(mine["grad_norm"]) and np.isinf(theirs["grad_norm"])
                else:
                    assert rel_err(theirs["grad_norm"], mine["grad_norm"]) <= tol, (n, other)
                    assert mine["grad_norm"] > CLIP  # clipping acts
        loss = np.mean([r["steps"][n]["loss"] for r in runs])
        for other in ("zero", "twin"):
            assert rel_err(jax_step[other]["loss"], loss) <= tol, (n, other)


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(results):
    runs, steps = results("w2_ep2_fp16", 2)
    scaler = LossScaler(scale=2.0 ** FP16_POWER, dynamic=True, window=FP16_WINDOW,
                        hysteresis=FP16_HYSTERESIS, hysteresis_left=FP16_HYSTERESIS)
    expected = []
    for n in range(STEPS):
        scaler.update(n + 1 in POISON)
        expected.append(scaler.scale)
    assert expected[:4] == [256.0, 256.0, 128.0, 128.0] and max(expected) > 256.0
    for run in runs:
        assert [s["metrics"]["loss_scale"] for s in run["steps"]] == expected
        before, *skipped = (run["steps"][n - 2]["pieces"] for n in (POISON[0], *POISON))
        for pieces in skipped:  # this rank's partitions did not move
            for a, b in zip(before, pieces, strict=True):
                for x, y in zip(a[3:], b[3:], strict=True):
                    np.testing.assert_array_equal(x, y)
    assert [s["zero"]["loss_scale"] for s in steps] == expected


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_loss_scale_update_is_torch_loss_scaler(hysteresis):
    """``update_loss_scale`` against the real ``LossScaler`` on a long overflow sequence."""
    cfg = LossScaleConfig(dynamic=True, initial_scale_power=6, window=2, hysteresis=hysteresis,
                          min_scale=4.0)
    scaler = LossScaler(scale=2.0 ** 6, dynamic=True, window=2, hysteresis=hysteresis,
                        min_scale=4.0, hysteresis_left=hysteresis)
    state = init_loss_scale(cfg)
    update = jax.jit(update_loss_scale, static_argnums=0)
    overflows = np.concatenate([np.zeros(5, bool), np.ones(20, bool),
                                np.random.default_rng(hysteresis).random(50) < 0.4])
    seen = set()
    for overflow in overflows:
        scaler.update(bool(overflow))
        state = update(cfg, state, jnp.bool_(overflow))
        assert (float(state.scale), int(state.good_steps), int(state.hysteresis_left)) == (
            scaler.scale, scaler.good_steps, scaler.hysteresis_left)
        seen.add(scaler.scale)
    assert cfg.min_scale in seen and max(seen) > 2.0 ** 6
