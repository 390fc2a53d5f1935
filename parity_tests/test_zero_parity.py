"""ZeRO parity: the torch engine (stages 1 and 2, real gloo ranks) vs the reference sharded step
(``reference/zero.py``) and its unsharded twin, by FQN, after each of 10 steps.

torch: ``run_world`` spawns W gloo ranks; each builds the model with ``train.build_model``,
``engine.initialize`` with a ``Config`` (``zero_optimization.stage`` 1 or 2, ``moe.ep_size``,
``moe.max_group_size``), reads its rows ``[r·b, (r+1)·b)`` of each global batch through
``moezero.data.Batches`` and runs forward → backward → ``reduce_gradients`` →
``optimizer_step``. Every step it records its local gradients (a post-accumulate hook
registered before the engine's, so it runs before stage 2 frees them), its step count and loss
scaler before the step, and after the step its params and its partitions of the fp32 master,
exp_avg and exp_avg_sq (``Optimizer.state_pieces``). The parent merges the ranks (every
element owned exactly once; replicas bit-equal).

Two comparisons, both by FQN after every step:

- **Isolated step** (``isolated_step``): step n is redone by ``zero_apply_grads`` (on a (W/ep,
  ep) mesh of forced host devices, row r = torch rank r's local gradients) and by
  ``twin_apply_grads`` (their mean), both from torch's state before step n. Only the step's
  own numerics can differ (reduce-scatter, norm, unscale, clip, AdamW, loss scale, gather),
  so fp32 holds 1e-6; ``test_isolated_step_detects_bugs`` shows that it catches real bugs.
- **Trajectory** (``jax_run``): ``zero_train_step`` and ``twin_train_step`` run all 10 steps
  from the torch initial weights with their own forward and backward on the same global
  batches (``split_batch`` gives rank r the same rows). Gradient kernels differ by ulps and
  AdamW amplifies those of noise-level elements, hence looser, measured tolerances.

Compared: master weights, exp_avg, exp_avg_sq (torch vs sharded, torch vs twin), the gathered
params, the global grad norm, lr, loss scale and skip flag; and once: both sides' optimizer
groups and partitions (the same plan). Tolerances and measured errors:
``parity_tests.tolerances.ZERO``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from moezero.config import Config
from moezero.data import Batches, make_corpus
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.plan import plan_groups, plan_partitions
from moezero.reference.optim import OptimConfig, make_optimizer
from moezero.reference.scaling import (
    LossScaleConfig,
    LossScaleState,
    init_loss_scale,
    update_loss_scale,
)
from moezero.reference.weights import from_fqn_dict, param_shapes, to_fqn_dict
from moezero.reference.zero import (
    adam_moments,
    init_twin_state,
    init_zero_state,
    state_shardings,
    twin_apply_grads,
    twin_train_step,
    zero_apply_grads,
    zero_train_step,
)
from moezero.reference.zero_layout import (
    ZeroConfig,
    make_mesh,
    param_specs,
    plan_stacks,
    stack_arrays,
    stack_fqns,
    user_groups,
)
from moezero.train import build_model
from moezero.zero.adamw import LossScaler
from parity_tests.models import SEQ, engine_config, tiny
from parity_tests.tolerances import SCHEDULE_REL, ZERO
from tests.support.compare import errors_by_fqn, record, rel_err
from tests.support.world import run_world

MODEL = tiny(n_layers=1)  # dim 32, 2 heads, ffn 48, 4 experts, top-2, vocab 64
ROWS = 2  # rows per rank
STEPS = 10
CAP = 999  # moe.max_group_size: odd and < one expert weight: sliced params, padded groups
CLIP = 0.5  # grad norms here are 0.75-1.6: clipping acts on every step
FP16_POWER, FP16_WINDOW, FP16_HYSTERESIS = 8, 3, 2
POISON = (2, 3)  # fp16 runs: 1-based steps whose last rank's loss is multiplied by inf
STATES = ("master", "exp_avg", "exp_avg_sq")


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
    "w2_ep2_fp16": Case(2, 2, "fp16", poison=POISON),
    "w2_ep2_bf16": Case(2, 2, "bf16"),
    "w4_ep1": Case(4, 1),
    "w4_ep2": Case(4, 2),
}
# The cases each spawned world runs (spawning is the slow part); only the first is not slow.
WORLDS = (("w2_ep1", "w2_ep2", "w2_ep2_fp16"), ("w2_ep2_bf16",), ("w4_ep1", "w4_ep2"))
FAST = WORLDS[0]


# ---------------------------------------------------------------------------- torch ranks


def torch_run(cfg_data: dict, world_of_batch: int, poison: tuple[int, ...]) -> dict:
    """This rank's view of STEPS engine steps: local grads, state before, params and state
    partitions after each."""
    cfg = Config.model_validate(cfg_data)
    topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    model = build_model(cfg, topo)
    grads = {}  # this step's local gradients; an expert that saw no token has none (zero)
    for fqn, p in model.named_parameters():  # before the engine's hooks: these run first
        p.register_post_accumulate_grad_hook(_keep_grad(grads, fqn))
    engine = initialize(model, cfg, topology=topo, device="cpu")
    data = Batches(make_corpus(None, vocab=cfg.data.synthetic_vocab, sources=2, seed=7),
                   global_batch=ROWS * world_of_batch, seq_len=cfg.train.seq_len, seed=0,
                   dp_rank=topo.rank, dp_size=topo.world_size)
    groups = engine.groups
    out = {"rank": topo.rank, "plan": groups.plan, "partitions": groups.partitions,
           "user_groups": groups.user_groups, "initial": _params(engine),
           "initial_pieces": _pieces(engine), "steps": []}
    for step in range(1, STEPS + 1):
        grads.clear()
        loss, _ = engine.forward(torch.from_numpy(data.next()))
        bad = step in poison and topo.rank == topo.world_size - 1
        engine.backward(loss * float("inf") if bad else loss)
        before = {"step_count": engine.step_count, "scaler": engine.scaler.state_dict()}
        engine.reduce_gradients()
        metrics = engine.optimizer_step()
        out["steps"].append({"metrics": metrics, "loss": loss.item(), "pieces": _pieces(engine),
                             "params": _params(engine), "grads": dict(grads),
                             "before": before})
    return out


def _keep_grad(store: dict, fqn: str):
    def hook(p):
        assert p.grad is not None, f"{fqn}: gradient freed before the test's hook ran"
        store[fqn] = p.grad.detach().float().clone().numpy()  # exact for bf16/fp16
    return hook


def _params(engine) -> dict:
    return {k: p.detach().float().clone().numpy() for k, p in engine.params.items()}


def _pieces(engine) -> list:
    return [(piece.fqn, piece.start, piece.stop, *(views[k].clone().numpy() for k in STATES))
            for piece, views in engine.optimizer.state_pieces()]


def torch_cases(names: tuple[str, ...]) -> dict:
    """Every (case, stage) of ``names`` in this world, in order."""
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


def merge_pieces(ranks: list[list]) -> tuple[dict, dict, dict]:
    """(master, exp_avg, exp_avg_sq) by FQN from every rank's partitions, each element once."""
    shapes = param_shapes(MODEL)
    full = [{k: np.zeros(int(np.prod(s)), np.float32) for k, s in shapes.items()} for _ in STATES]
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
ZAPPLY = jax.jit(zero_apply_grads, static_argnums=(0, 1))
TAPPLY = jax.jit(twin_apply_grads, static_argnums=0)


def _np(tree) -> dict:
    return {k: np.asarray(v, np.float64) for k, v in to_fqn_dict(tree).items()}


def _jax_step(cfg: ZeroConfig, zs, zm, ts, tm) -> dict:
    """One step of both JAX sides, as numpy by FQN."""
    (mz, nz), (mt, nt) = adam_moments(zs.opt_state), adam_moments(ts.opt_state)
    return {"zero": {k: float(v) for k, v in zm.items()},
            "twin": {k: float(v) for k, v in tm.items()},
            "zero_state": (stack_fqns(cfg, zs.master), stack_fqns(cfg, mz), stack_fqns(cfg, nz)),
            "twin_state": (_np(ts.params), _np(mt), _np(nt)), "zero_params": _np(zs.params)}


def _twin_config(cfg: ZeroConfig) -> ZeroConfig:
    return dataclasses.replace(cfg, ep_size=1, max_group_size=None)  # one compile per W


def jax_run(case: Case, initial: dict, lr_factor: float = 1.0) -> list[dict]:
    """Trajectory: STEPS steps of the sharded step and of its twin from the torch initial
    weights, each with its own forward and backward. ``lr_factor``: a planted bug, the
    reference's learning rate scaled (``test_trajectory_tolerances_catch_a_wrong_lr``)."""
    cfg = case.zero_config()
    if lr_factor != 1.0:
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim,
                                                                 lr=cfg.optim.lr * lr_factor))
    twin_cfg = _twin_config(cfg)
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
        out.append(_jax_step(cfg, zs, zm, ts, tm))
    return out


def _loss_scale(before: dict) -> LossScaleState:
    s = before["scaler"]
    return LossScaleState(jnp.float32(s["scale"]), jnp.int32(s["good_steps"]),
                          jnp.int32(s["hysteresis_left"]))


def zero_state(cfg: ZeroConfig, mesh, state: tuple, before: dict):
    """The reference sharded state holding torch's (master, exp_avg, exp_avg_sq) by FQN, its
    step count (Adam's and the schedule's) and its loss scaler."""
    master, mu, nu = (from_fqn_dict(d, MODEL) for d in state)
    zs = init_zero_state(cfg, mesh, master)
    count = jnp.int32(before["step_count"])
    opt = optax.tree.set(zs.opt_state, mu=stack_arrays(cfg, mu), nu=stack_arrays(cfg, nu),
                         count=count)
    zs = zs._replace(step=count, opt_state=opt, loss_scale=_loss_scale(before))
    return jax.device_put(zs, state_shardings(cfg, mesh, zs))


def twin_state(cfg: ZeroConfig, state: tuple, before: dict):
    """The twin's state holding the same (as ``zero_state``)."""
    master, mu, nu = (from_fqn_dict(d, MODEL) for d in state)
    count = jnp.int32(before["step_count"])
    opt = optax.tree.set(make_optimizer(cfg.optim).init(master), mu=mu, nu=nu, count=count)
    return init_twin_state(cfg, master)._replace(step=count, opt_state=opt,
                                                 loss_scale=_loss_scale(before))


def rank_grads(cfg: ZeroConfig, ranks: list[dict]) -> list[dict]:
    """Every rank's local gradients as a full params tree in the compute dtype: zeros where
    the rank holds no such param (other EP ranks' experts) or it got no gradient."""
    shapes, dtype = param_shapes(MODEL), jnp.dtype(cfg.dtype)
    return [from_fqn_dict({k: g.get(k, np.zeros(s, np.float32)) for k, s in shapes.items()},
                          MODEL, dtype) for g in ranks]


def isolated_step(case: Case, runs: list[dict], n: int, mutate=None) -> dict:
    """Step ``n`` (0-based) of torch's run, redone by both JAX steps from torch's state before
    it and its ranks' local gradients. ``mutate(cfg, state, grads_W) -> (cfg, state,
    grads_W)``: a bug planted in the sharded side's inputs (test_isolated_step_detects_bugs).
    """
    cfg = case.zero_config()
    mesh = make_mesh(case.world, case.ep)
    pieces = [r["initial_pieces"] if n == 0 else r["steps"][n - 1]["pieces"] for r in runs]
    state, before = merge_pieces(pieces), runs[0]["steps"][n]["before"]
    assert all(r["steps"][n]["before"] == before for r in runs)
    grads = rank_grads(cfg, [r["steps"][n]["grads"] for r in runs])
    # the twin's input: torch's reduction (fp32 sum / W, rounded to the compute dtype)
    mean = jax.tree.map(lambda *g: (sum(x.astype(jnp.float32) for x in g) / case.world)
                        .astype(g[0].dtype), *grads)
    grads_W = jax.tree.map(lambda *g: jnp.stack(g), *grads)
    zs = zero_state(cfg, mesh, state, before)
    if mutate is not None:
        cfg, zs, grads_W = mutate(cfg, zs, grads_W)
    zs, zm = ZAPPLY(cfg, mesh, zs, grads_W)
    twin_cfg = _twin_config(case.zero_config())
    ts, tm = TAPPLY(twin_cfg, twin_state(twin_cfg, state, before), mean)
    return _jax_step(cfg, zs, zm, ts, tm)


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``get(name, stage)`` -> torch ranks' results; each world runs once."""
    worlds = {}

    def get(name: str, stage: int) -> list[dict]:
        names = next(w for w in WORLDS if name in w)
        if names not in worlds:
            worlds[names] = run_world(torch_cases, CASES[name].world,
                                      tmp_path_factory.mktemp("zero"), names, timeout_s=300)
        return [r[(name, stage)] for r in worlds[names]]

    return get


@pytest.fixture(scope="module")
def trajectory(results):
    """``get(name, stage)`` -> (torch ranks, JAX trajectory); JAX runs once per case (the
    torch init is keyed by FQN, the same for every stage)."""
    runs = {}

    def get(name: str, stage: int) -> tuple[list[dict], list[dict]]:
        ranks = results(name, stage)
        initial = merge_params([r["initial"] for r in ranks])
        if name not in runs:
            runs[name] = (initial, jax_run(CASES[name], initial))
        for fqn, value in runs[name][0].items():
            np.testing.assert_array_equal(initial[fqn], value)
        return ranks, runs[name][1]

    return get


def _case(name: str, stage: int):
    marks = () if name in FAST else (pytest.mark.slow,)
    return pytest.param(name, stage, marks=marks, id=f"{name}-stage{stage}")


CASE_STAGES = [_case(n, s) for n, c in CASES.items() for s in c.stages]


def step_errors(runs: list[dict], jax_step: dict, n: int) -> dict[str, tuple[float, str]]:
    """Worst (relative error, FQN) at step ``n`` (0-based) of each compared pair of states."""
    torch_state = merge_pieces([r["steps"][n]["pieces"] for r in runs])
    out = {}
    for i, what in enumerate(STATES):
        for other in ("zero", "twin"):
            out[f"{what}/torch-{other}"] = errors_by_fqn(torch_state[i],
                                                         jax_step[f"{other}_state"][i])[0]
    params = merge_params([r["steps"][n]["params"] for r in runs])  # compute dtype, gathered
    out["params/torch-zero"] = errors_by_fqn(params, jax_step["zero_params"])[0]
    return out


def check_metrics(runs: list[dict], jax_step: dict, n: int, case: Case, norm_tol: float,
                  what: str):
    """Skip flag, loss scale, lr and grad norm of step ``n`` on every rank vs both JAX sides."""
    for run in runs:  # every rank reports the same
        mine = run["steps"][n]["metrics"]
        assert mine["skipped"] == (n + 1 in case.poison)
        for other in ("zero", "twin"):
            theirs = jax_step[other]
            assert bool(theirs["skipped"]) == mine["skipped"]
            assert theirs["loss_scale"] == mine["loss_scale"]
            assert rel_err(theirs["lr"], mine["lr"]) <= SCHEDULE_REL  # fp32 vs float64
            if mine["skipped"]:
                assert np.isinf(mine["grad_norm"]) and np.isinf(theirs["grad_norm"])
            else:
                err = rel_err(theirs["grad_norm"], mine["grad_norm"])
                record(f"zero {what} {case.precision} grad_norm/torch-{other}", err, norm_tol)
                assert err <= norm_tol, f"step {n + 1}: grad norm vs {other}: {err:.2e}"
                assert mine["grad_norm"] > CLIP  # clipping acts


# --------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("name", "stage"), CASE_STAGES)
def test_both_sides_plan_the_same_groups_and_partitions(results, name, stage):
    runs = results(name, stage)
    cfg = CASES[name].zero_config()
    groups = plan_groups(param_specs(cfg), max_group_size=CAP)
    for run in runs:
        assert run["plan"] == groups
        assert run["partitions"] == plan_partitions(groups, world_size=CASES[name].world)
        assert set(run["user_groups"]) == set(user_groups(cfg))  # same weight decay rules
    assert any(len(g.members) > 1 for g in groups) and any(
        p.padded_numel > p.numel for p in runs[0]["partitions"])


@pytest.mark.parametrize(("name", "stage"), CASE_STAGES)
def test_isolated_step_by_fqn_after_every_step(results, name, stage):
    """Each of the 10 steps, redone from torch's state and local grads: master, exp_avg,
    exp_avg_sq (vs the sharded step and vs the twin), gathered params, grad norm, lr, loss
    scale and skips."""
    runs, case = results(name, stage), CASES[name]
    tol = ZERO[case.precision]
    for n in range(STEPS):
        jax_step = isolated_step(case, runs, n)
        for pair, (err, fqn) in step_errors(runs, jax_step, n).items():
            limit = tol.step_params if pair.startswith("params") else tol.step
            record(f"zero step {case.precision} {pair}", err, limit)
            assert err <= limit, f"step {n + 1}: {pair} {fqn} off by {err:.2e} (tol {limit})"
        check_metrics(runs, jax_step, n, case, tol.step, "step")


def _trajectory_limit(name: str, what: str, n: int) -> float | None:
    """The trajectory tolerance of state ``what`` after step ``n`` (0-based); None: not
    compared."""
    tol = ZERO[CASES[name].precision]
    if what in ("master", "params"):
        return tol.master_1 if n == 0 else tol.master
    if n == 0 and what == "exp_avg":  # (1 − β1)·clip·reduced gradient
        return tol.exp_avg_1
    return tol.moments


def state_violations(name: str, runs: list[dict], steps: list[dict],
                     report: bool = True) -> list[str]:
    """Each step's fp32 state (and gathered params) beyond its trajectory tolerance
    (``report``: recorded for PARITY_REPORT)."""
    out = []
    for n in range(STEPS):
        for pair, (err, fqn) in step_errors(runs, steps[n], n).items():
            limit = _trajectory_limit(name, pair.split("/")[0], n)
            if limit is not None:
                if report:
                    record(f"zero trajectory {CASES[name].precision} {pair} n={min(n, 1)}",
                           err, limit)
                if err > limit:
                    out.append(f"step {n + 1}: {pair} {fqn} off by {err:.2e} (tol {limit})")
    return out


def metric_violations(name: str, runs: list[dict], steps: list[dict],
                      report: bool = True) -> list[str]:
    """Each step's mean loss and (unskipped) grad norm beyond its trajectory tolerance
    (``report``: recorded for PARITY_REPORT)."""
    case, out = CASES[name], []
    tol = ZERO[case.precision]
    for n, jax_step in enumerate(steps):
        mine = runs[0]["steps"][n]["metrics"]
        loss = np.mean([r["steps"][n]["loss"] for r in runs])
        for other in ("zero", "twin"):
            checks = [("loss", rel_err(jax_step[other]["loss"], loss), tol.loss)]
            if not mine["skipped"]:
                checks.append(("grad_norm", rel_err(jax_step[other]["grad_norm"],
                                                    mine["grad_norm"]), tol.grad_norm))
            for what, err, limit in checks:
                if report:
                    record(f"zero trajectory {case.precision} {what}/torch-{other}", err, limit)
                if err > limit:
                    out.append(f"step {n + 1}: {what} vs {other} off by {err:.2e} (tol {limit})")
    return out


@pytest.mark.parametrize(("name", "stage"), CASE_STAGES)
def test_trajectory_state_by_fqn_after_every_step(trajectory, name, stage):
    """Each side's own 10-step run: fp32 master, exp_avg and exp_avg_sq, torch vs the sharded
    step and vs the twin (``ZERO``: why these are looser than the isolated step's)."""
    runs, steps = trajectory(name, stage)
    bad = state_violations(name, runs, steps)
    assert not bad, bad[:5]
    first, last = steps[0]["twin_state"][0], steps[-1]["twin_state"][0]
    assert max(rel_err(last[k], first[k]) for k in first) > 1e-3  # it trained


@pytest.mark.parametrize(("name", "stage"), CASE_STAGES)
def test_trajectory_loss_grad_norm_lr_loss_scale_and_skips(trajectory, name, stage):
    runs, steps = trajectory(name, stage)
    case = CASES[name]
    for n, jax_step in enumerate(steps):  # skips, scales and lr exactly; the norm as below
        check_metrics(runs, jax_step, n, case, ZERO[case.precision].grad_norm, "trajectory")
    bad = metric_violations(name, runs, steps)
    assert not bad, bad[:5]


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=() if n in FAST else (pytest.mark.slow,))
    for n in CASES if CASES[n].precision != "fp32"])
def test_trajectory_tolerances_catch_a_wrong_lr(trajectory, name):
    """The bf16/fp16 trajectory tolerances are tight enough to matter: the reference run with
    a learning rate 20% too high fails them (stage 2)."""
    runs, _ = trajectory(name, 2)
    initial = merge_params([r["initial"] for r in runs])
    wrong = jax_run(CASES[name], initial, lr_factor=1.2)
    bad = (state_violations(name, runs, wrong, report=False)
           + metric_violations(name, runs, wrong, report=False))
    assert bad, "a 20% wrong learning rate passed every trajectory tolerance"


def _scale_experts(cfg, state, grads_W):
    """Expert grads divided by the EDP size W/ep instead of W (a wrong expert average)."""
    scaled = jax.tree_util.tree_map_with_path(
        lambda path, g: g * cfg.ep_size if "experts" in jax.tree_util.keystr(path) else g,
        grads_W)
    return cfg, state, scaled


def _roll_shard(cfg, state, grads_W):
    """A dense group's masters one DP rank off (device r steps rank r - 1's shard)."""
    stack = next(s for s in plan_stacks(cfg) if not s.is_expert)
    master = dict(state.master)
    master[stack.name] = jnp.roll(master[stack.name], stack.padded_numel // cfg.world_size)
    return cfg, state._replace(master=master), grads_W


MUTATIONS = {
    "no_clip": lambda cfg, s, g: (dataclasses.replace(cfg, optim=optim(None)), s, g),
    "expert_grads_over_edp": _scale_experts,
    "rolled_shard": _roll_shard,
    # with clipping active, Adam's state hardly sees a global scale: only the norm shows it
    "no_division_by_W": lambda cfg, s, g: (cfg, s, jax.tree.map(lambda x: x * cfg.world_size, g)),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_isolated_step_detects_bugs(results, mutation):
    """The isolated comparison can fail: a bug planted in the sharded side's inputs of step 2
    (W = 2, ep = 2, stage 2) breaks the fp32 tolerance (torch vs the sharded step)."""
    runs, case = results("w2_ep2", 2), CASES["w2_ep2"]
    jax_step = isolated_step(case, runs, 1, MUTATIONS[mutation])
    errors = {k: e for k, (e, _) in step_errors(runs, jax_step, 1).items() if "twin" not in k}
    mine = runs[0]["steps"][1]["metrics"]["grad_norm"]
    errors["grad_norm"] = rel_err(jax_step["zero"]["grad_norm"], mine)
    record(f"zero detects {mutation} (must exceed)", max(errors.values()),
           ZERO["fp32"].step)
    assert max(errors.values()) > 100 * ZERO["fp32"].step, errors


@pytest.mark.parametrize("stage", CASES["w2_ep2_fp16"].stages)
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(trajectory, stage):
    runs, steps = trajectory("w2_ep2_fp16", stage)
    scaler = LossScaler(scale=2.0 ** FP16_POWER, dynamic=True, window=FP16_WINDOW,
                        hysteresis=FP16_HYSTERESIS, hysteresis_left=FP16_HYSTERESIS)
    expected = []
    for n in range(STEPS):
        scaler.update(n + 1 in POISON)
        expected.append(scaler.scale)
    assert expected[:4] == [256.0, 256.0, 128.0, 128.0] and max(expected) > 256.0
    for run in runs:
        assert [s["metrics"]["loss_scale"] for s in run["steps"]] == expected
        for n in POISON:  # the inf is in one rank's dense grads (EP carries it to experts)
            dense = [g for k, g in run["steps"][n - 1]["grads"].items() if ".experts." not in k]
            finite = all(np.isfinite(g).all() for g in dense)
            assert finite == (run["rank"] != len(runs) - 1), (n, run["rank"])
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
