"""Checkpoint parity: torch saves mid-run, the reference loads it and continues as torch did.

torch: ``run_world`` spawns W = 2 gloo ranks (``ranks.train_and_save``); each builds the tiny
model with ``train.build_model``, ``engine.initialize`` with a ``Config`` (ep 2, ZeRO stage 2,
fp32, a group cap that cuts parameters into fragments and pads groups) and runs STEPS
``engine.train_step``s on its rows ``[r·b, (r+1)·b)`` of the synthetic corpus' global batches
(``moezero.data.Batches``). After step SAVE_AT it calls ``engine.save_checkpoint`` (the data
position as client state) and keeps going without stopping: the uninterrupted continuation.

JAX: ``moezero.reference.checkpoint.load_train_state`` reads the masters and Adam moments by FQN
through the plan's store (``read_param``: fragments joined, any topology) into the optax AdamW
state with the saved step count, takes the data position from the manifest and continues
STEPS − SAVE_AT steps of ``moezero.reference.optim.train_step`` (world_size 2: each rank's slice routed
on its own, the mean of the two rank losses).

Checked: the loaded masters and moments equal torch's state at the save bit for bit (fp32),
and the step counts agree; every continued step's loss and grad norm are within
``FP32.train_loss_rel`` of torch's, and its lr within ``SCHEDULE_REL``. And the checks can fail:
one corrupted moment on disk breaks the bit-exact check, naming it, and continuing from a state
that is wrong by one step count or by fresh moments breaks the loss tolerance. The other
direction too: torch (W = 1, stage 0) loads ``moezero.reference.checkpoint.save_train_state``'s
checkpoint of the same state under another plan bit for bit.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moezero.config import Config
from moezero.data import Batches, make_corpus
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.plan import store
from moezero.reference.checkpoint import load_train_state, save_train_state
from moezero.reference.optim import OptimConfig, TrainConfig, train_step
from moezero.reference.weights import to_fqn_dict
from parity_tests import ranks
from parity_tests.models import SEQ, engine_config, tiny, torch_model
from parity_tests.tolerances import FP32, SCHEDULE_REL
from tests.support.compare import assert_rel, rel_err
from tests.support.world import run_world

WORLD, EP, STAGE = 2, 2, 2
MODEL = tiny()  # dim 32, 2 layers, 2 heads, ffn 48, 4 experts, top-2, vocab 64
ROWS = 2  # rows per rank
STEPS, SAVE_AT = 8, 4
CAP = 999  # moe.max_group_size: < one expert weight (1536): fragments and padded groups
OPTIM = OptimConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                    gradient_clipping=1.0, warmup_steps=2, min_lr_ratio=0.1, total_steps=STEPS)
TRAIN = TrainConfig(model=MODEL, optim=OPTIM, world_size=WORLD, dtype="float32")
STATES = ("master", "exp_avg", "exp_avg_sq")
jit_train_step = jax.jit(train_step, static_argnums=0)


def torch_config() -> dict:
    cfg = engine_config(MODEL, OPTIM, ep_size=EP, stage=STAGE)
    cfg.moe.max_group_size = CAP
    return Config.model_validate(cfg.model_dump(by_alias=True)).model_dump(by_alias=True)


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    """(checkpoint directory, both ranks' results)."""
    root = tmp_path_factory.mktemp("ckpt")
    by_rank = run_world(ranks.train_and_save, WORLD, tmp_path_factory.mktemp("w2"),
                        torch_config(), ROWS, STEPS, SAVE_AT, str(root), timeout_s=180)
    assert by_rank[0]["saved"] == by_rank[1]["saved"] == str(root / "step_00000004")
    return root / "step_00000004", by_rank


def torch_state_at_save(by_rank: list[dict]) -> dict[str, dict[str, np.ndarray]]:
    """``{state: {fqn: fp32 array}}`` from the ranks' partitions, every element exactly once."""
    shapes = {fqn: tuple(shape) for fqn, shape in
              store.read_manifest(by_rank[0]["saved"]).layout.shapes}
    full = {s: {k: np.full(int(np.prod(v)), np.nan, np.float32) for k, v in shapes.items()}
            for s in STATES}
    count = {k: np.zeros(int(np.prod(v)), int) for k, v in shapes.items()}
    for result in by_rank:
        for fqn, start, stop, *values in result["pieces"]:
            for s, value in zip(STATES, values, strict=True):
                assert value.dtype == np.float32
                full[s][fqn][start:stop] = value
            count[fqn][start:stop] += 1
    bad = [k for k, c in count.items() if not (c == 1).all()]
    assert not bad, f"the ranks' partitions do not cover these params exactly once: {bad[:3]}"
    return {s: {k: v.reshape(shapes[k]) for k, v in d.items()} for s, d in full.items()}


def loaded_state(state) -> dict[str, dict[str, np.ndarray]]:
    """``{state: {fqn: array}}`` of a reference TrainState (masters, mu, nu)."""
    trees = (state.params, optax.tree.get(state.opt_state, "mu"),
             optax.tree.get(state.opt_state, "nu"))
    return {s: {k: np.asarray(v) for k, v in to_fqn_dict(t).items()}
            for s, t in zip(STATES, trees, strict=True)}


def unequal(mine: dict, theirs: dict) -> list[str]:
    """``state/fqn`` of every tensor that is not bit-equal (fp32 both), in order."""
    out = []
    for s in STATES:
        assert mine[s].keys() == theirs[s].keys(), s
        for fqn, value in theirs[s].items():
            assert mine[s][fqn].dtype == value.dtype == np.float32, (s, fqn)
            if not np.array_equal(mine[s][fqn], value):
                out.append(f"{s}/{fqn}")
    return out


def continue_reference(state, data_state: dict) -> list[dict]:
    """STEPS − SAVE_AT reference steps from ``state`` on the global batches from the saved
    data position; each step's metrics as floats."""
    data = Batches(make_corpus(None, vocab=32, sources=2, seed=7), global_batch=ROWS * WORLD,
                   seq_len=SEQ, seed=0, dp_rank=0, dp_size=1)
    data.load_state_dict(data_state)
    out = []
    for _ in range(SAVE_AT, STEPS):
        state, metrics = jit_train_step(TRAIN, state, jnp.asarray(data.next(), jnp.int32))
        out.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return out


@pytest.fixture(scope="module")
def resumed(torch_run):
    """(loaded TrainState, manifest, the reference's continued metrics)."""
    ckpt, _ = torch_run
    state, manifest = load_train_state(ckpt, TRAIN)
    return state, manifest, continue_reference(state, manifest.state["client"]["data"])


def test_the_checkpoint_is_a_real_stage2_ep2_save_with_fragments(torch_run, resumed):
    ckpt, _ = torch_run
    _, manifest, _ = resumed
    assert store.verify(ckpt) == []
    assert manifest.topology["world_size"] == WORLD and manifest.topology["zero_stage"] == STAGE
    assert manifest.topology["ep_sizes"] == [EP]
    assert any("@" in t.key for f in manifest.layout.files for t in f.tensors)
    assert manifest.state["client"] == {"data": {"step": SAVE_AT, "seed": 0}}


def test_loaded_masters_and_moments_are_torch_state_at_save_bit_exactly(torch_run, resumed):
    _, by_rank = torch_run
    state, manifest, _ = resumed
    assert unequal(loaded_state(state), torch_state_at_save(by_rank)) == []
    assert manifest.state["engine"]["step_count"] == SAVE_AT
    counts = [int(v) for _, v in optax.tree.get_all_with_path(state.opt_state, "count")]
    assert int(state.step) == SAVE_AT and counts == [SAVE_AT, SAVE_AT]


def test_reference_continues_as_torch_did_without_stopping(torch_run, resumed):
    """Every continued step: loss and grad norm within the fp32 training tolerance, lr within
    the schedule's; every torch rank reports the same metrics."""
    _, by_rank = torch_run
    _, _, ref = resumed
    mine = by_rank[0]["metrics"][SAVE_AT:]
    assert len(mine) == len(ref) == STEPS - SAVE_AT
    for m, other in zip(mine, by_rank[1]["metrics"][SAVE_AT:], strict=True):
        assert (m["loss"], m["grad_norm"], m["lr"]) == (
            other["loss"], other["grad_norm"], other["lr"])
    for n, (m, r) in enumerate(zip(mine, ref, strict=True), start=SAVE_AT + 1):
        assert not m["skipped"]
        assert_rel(r["loss"], m["loss"], FP32.train_loss_rel, f"resumed train loss, step {n}")
        assert_rel(r["grad_norm"], m["grad_norm"], FP32.train_loss_rel,
                   f"resumed grad norm, step {n}")
        assert_rel(r["lr"], m["lr"], SCHEDULE_REL, f"resumed lr, step {n}")
    assert ref[-1]["loss"] < by_rank[0]["metrics"][0]["loss"]  # it trains
    assert any(r["clip_coef"] < 1.0 for r in ref)  # clipping acts


def test_one_corrupted_moment_fails_the_bit_exact_check(torch_run, tmp_path):
    ckpt, by_rank = torch_run
    copy = shutil.copytree(ckpt, tmp_path / ckpt.name)
    fqn = "layers.1.moe.experts.3.w2.weight"  # an expert of EP rank 1, fragmented by the cap
    manifest = store.read_manifest(copy)
    f, t = manifest.layout.pieces(fqn, "exp_avg")[-1]
    with open(copy / f.name, "r+b") as fh:  # its last element, nudged by one ulp
        fh.seek(f.data_start + t.end - 4)
        value = np.frombuffer(fh.read(4), np.float32)
        fh.seek(f.data_start + t.end - 4)
        fh.write(np.nextafter(value, np.float32(np.inf)).tobytes())
    state, _ = load_train_state(copy, TRAIN)
    assert unequal(loaded_state(state), torch_state_at_save(by_rank)) == [f"exp_avg/{fqn}"]


@pytest.mark.parametrize("wrong", ["step count + 1", "fresh moments"])
def test_a_wrong_resumed_state_fails_the_loss_tolerance(torch_run, resumed, wrong):
    """The tolerance separates: resuming with the schedule and bias correction one step off,
    or with Adam's moments reset, moves some continued loss by more than it allows."""
    _, by_rank = torch_run
    state, manifest, _ = resumed
    if wrong == "step count + 1":
        count = state.step + 1
        state = state._replace(step=count,
                               opt_state=optax.tree.set(state.opt_state, count=count))
    else:
        zeros = jax.tree.map(jnp.zeros_like, state.params)
        state = state._replace(opt_state=optax.tree.set(state.opt_state, mu=zeros, nu=zeros))
    ref = continue_reference(state, manifest.state["client"]["data"])
    mine = by_rank[0]["metrics"][SAVE_AT:]
    worst = max(rel_err(r["loss"], m["loss"]) for m, r in zip(mine, ref, strict=True))
    assert worst > 10 * FP32.train_loss_rel, f"{wrong}: worst loss error only {worst:.2e}"


def test_torch_loads_what_the_reference_saves(resumed, tmp_path):
    """The other direction, under another plan: the reference re-saves the loaded state with
    ep 1 and no cap; a W = 1, stage 0 torch engine loads it bit for bit, counts included."""
    state, _, _ = resumed
    path = save_train_state(tmp_path, TRAIN, state, client={"data": {"step": SAVE_AT, "seed": 0}})
    assert store.verify(path) == []
    engine = initialize(torch_model(MODEL), engine_config(MODEL, OPTIM),
                        topology=build_topology([1], num_experts=MODEL.num_experts), device="cpu")
    assert engine.load_checkpoint(path) == {"data": {"step": SAVE_AT, "seed": 0}}
    assert engine.step_count == SAVE_AT
    flat = {s: {fqn: np.zeros(p.numel(), np.float32) for fqn, p in engine.params.items()}
            for s in STATES}
    for piece, views in engine.optimizer.state_pieces():  # W = 1: it owns every element
        for s in STATES:
            flat[s][piece.fqn][piece.start:piece.stop] = views[s].numpy()
    theirs = {s: {fqn: a.reshape(engine.params[fqn].shape) for fqn, a in arrays.items()}
              for s, arrays in flat.items()}
    assert unequal(loaded_state(state), theirs) == []
