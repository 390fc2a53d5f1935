"""ZeRO stages 0-2 (torch_impl/zero/): distributed runs equal the single-process run, the
tiled step equals the untiled one bit for bit, stage 0 (the replicated optimizer) steps bit
for bit like the sharded stages, the grad norm is invariant to ep, fp16 overflow skips the
step on every rank, clipping is honoured, and the tiled step's peak is smaller.

Spawning ranks dominates the cost (seconds per world on 2 cores), so each world runs many
configurations; module-scoped fixtures share them between the tests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moezero.config import Config
from moezero.data import Batches, make_corpus
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.train import build_model
from tests.support.compare import assert_close_by_fqn, rel_err
from tests.support.world import run_world
from tests.torch_impl.test_distributed import MICRO, merged, small_config
from tests.torch_impl.tolerances import RTOL

STEPS = 3
CAP = 1000  # < one expert weight (48 x 32 = 1536 elements): weights are sliced across groups
NORM_RTOL = 1e-6  # grad norm across ep sizes (fp32): only the summation order differs


def zcfg(*, stage: int, ep: int = 1, dtype: str = "fp32", tiled: bool = True,
         cap: int | None = None, clip: float | None = 1.0, experts: int = 4, **precision) -> dict:
    cfg = small_config(ep_size=ep, max_group_size=cap, num_experts=experts)
    cfg.zero_optimization.stage = stage
    cfg.zero_optimization.tiled_step = tiled
    cfg.zero_optimization.reduce_bucket_size = 3000  # several buckets, some split groups
    cfg.precision = cfg.precision.model_copy(update={"dtype": dtype, **precision})
    cfg.optimizer.gradient_clipping = clip
    cfg.optimizer.warmup_steps = 0
    return cfg.model_dump(by_alias=True)


def engine_and_batches(cfg_data: dict, world_of_batch: int):
    """An engine on this process group and the global batches (``world_of_batch`` micro-batches,
    each rank accumulating its share)."""
    cfg = Config.model_validate(cfg_data)
    topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    cfg.train.grad_accum_steps = world_of_batch // topo.world_size
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
    batches = Batches(make_corpus(None, vocab=32, sources=2, seed=7), seed=3, dp_rank=0,
                      dp_size=1, global_batch=MICRO * world_of_batch, seq_len=cfg.train.seq_len)
    return engine, topo, batches


def train_steps(cfg_data: dict, world_of_batch: int, steps: int = STEPS,
                overflow_steps: tuple[int, ...] = (), probe: bool = False) -> dict:
    """``steps`` optimizer steps on the global batch (split over ranks, looped at W=1).

    ``overflow_steps``: 1-based steps whose loss is made infinite on the last rank only.
    ``probe``: check after step 1 that exp_avg = (1 - beta1) * clip * reduced gradient.
    """
    engine, topo, batches = engine_and_batches(cfg_data, world_of_batch)
    initial = _params(engine)
    metrics, probe_err = [], None
    for step in range(1, steps + 1):
        slices = torch.from_numpy(batches.next()).split(MICRO)
        poison = step in overflow_steps and topo.rank == topo.world_size - 1
        for batch in slices[topo.rank::topo.world_size]:
            loss, _ = engine.forward(batch)
            engine.backward(loss * float("inf") if poison else loss)
        engine.reduce_gradients()
        grads = engine.gradients() if probe and step == 1 else None
        metrics.append(engine.optimizer_step())
        if grads is not None:
            probe_err = _exp_avg_error(engine, grads, metrics[-1]["grad_norm"])
    return {"rank": topo.rank, "metrics": metrics, "initial": initial, "params": _params(engine),
            "probe_err": probe_err, "step_count": engine.step_count}


def _params(engine) -> dict:
    return {k: p.detach().float().clone().numpy() for k, p in engine.params.items()}


def _exp_avg_error(engine, grads: dict, grad_norm: float) -> float:
    """Largest relative error of exp_avg against (1 - beta1) * clip * grad after step 1."""
    beta1, max_norm = engine.cfg.optimizer.betas[0], engine.cfg.optimizer.max_grad_norm
    clip = min(1.0, max_norm / grad_norm)
    worst = 0.0
    for piece, views in engine.optimizer.state_pieces():
        expected = grads[piece.fqn].reshape(-1)[piece.start:piece.stop].float() * clip * (1 - beta1)
        worst = max(worst, rel_err(views["exp_avg"].numpy(), expected.numpy()))
    return worst


def run_cases(cases: dict[str, tuple]) -> dict:
    """Run every case (``train_steps`` args) in this world, in order; results by name."""
    return {name: train_steps(*args) for name, args in cases.items()}


def by_name(results: list[dict], name: str) -> list[dict]:
    return [r[name] for r in results]


# ---------------------------------------------------------------------------- worlds
W2_CASES = {
    **{f"s{s}_ep{ep}": (zcfg(stage=s, ep=ep), 2) for s in (0, 1, 2) for ep in (1, 2)},
    # two micro-batches per rank: the reduction waits for the last one
    **{f"s{s}_ep2_accum": (zcfg(stage=s, ep=2), 4) for s in (1, 2)},
    **{f"{dt}_s{s}_tiled{t}": (zcfg(stage=s, ep=2, dtype=dt, tiled=t, cap=CAP), 2)
       for dt in ("fp32", "bf16") for s in (0, 1, 2) for t in (True, False)},
    **{f"nocap_s2_tiled{t}": (zcfg(stage=2, ep=2, tiled=t), 2) for t in (True, False)},
    "fp16_overflow": (zcfg(stage=2, ep=2, dtype="fp16", initial_scale_power=8, hysteresis=2),
                      2, 4, (1, 2)),
    "clipped": (zcfg(stage=2, ep=2, clip=0.05, cap=CAP), 2, STEPS, (), True),
}
W4_CASES = {
    **{f"s{s}_ep2": (zcfg(stage=s, ep=2), 4) for s in (0, 1, 2)},
    **{f"norm_ep{ep}": (zcfg(stage=2, ep=ep, cap=CAP), 4, 1) for ep in (1, 4)},
}


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    return run_world(run_cases, 2, tmp_path_factory.mktemp("w2"), W2_CASES, timeout_s=300)


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    return run_world(run_cases, 4, tmp_path_factory.mktemp("w4"), W4_CASES, timeout_s=300)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """W=1 oracles: the global batch of a W-rank run as W micro-batches of one process."""
    cases = {f"ref_w{w}": (zcfg(stage=0), w) for w in (2, 4)}
    cases["clipped"] = (zcfg(stage=0, clip=0.05), 2)
    cases.update({f"s{s}": (zcfg(stage=s), 2) for s in (1, 2)})
    (res,) = run_world(run_cases, 1, tmp_path_factory.mktemp("w1"), cases)
    return res


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world,name,batch", [(2, f"s{s}_ep{ep}", 2) for s in (0, 1, 2) for ep in (1, 2)]
                         + [(2, f"s{s}_ep2_accum", 4) for s in (1, 2)]
                         + [(4, f"s{s}_ep2", 4) for s in (0, 1, 2)])
def test_stage_equals_single_process(request, single, world, name, batch):
    """``batch``: micro-batches in the global batch, the W=1 oracle's accumulation steps."""
    runs = by_name(request.getfixturevalue(f"w{world}"), name)
    oracle = single[f"ref_w{batch}"]
    assert_close_by_fqn(merged(runs, "params"), oracle["params"], RTOL["fp32"])
    for got, want in zip(runs[0]["metrics"], oracle["metrics"], strict=True):
        assert rel_err(got["grad_norm"], want["grad_norm"]) <= RTOL["fp32"]
    if name.endswith("ep2") and world == 2:  # each rank holds different experts
        assert len(runs[0]["params"]) < len(oracle["params"])


@pytest.mark.parametrize("stage", [1, 2])
def test_single_process_stages_equal_stage0(single, stage):
    assert_close_by_fqn(single[f"s{stage}"]["params"], single["ref_w2"]["params"], RTOL["fp32"])


@pytest.mark.parametrize("name", [f"{d}_s{s}" for d in ("fp32", "bf16") for s in (0, 1, 2)]
                         + ["nocap_s2"])
def test_tiled_step_is_bit_identical_to_untiled(w2, name):
    for tiled, untiled in zip(by_name(w2, f"{name}_tiledTrue"), by_name(w2, f"{name}_tiledFalse"),
                              strict=True):
        assert tiled["params"].keys() == untiled["params"].keys()
        for fqn, value in tiled["params"].items():
            assert torch.equal(torch.from_numpy(value), torch.from_numpy(untiled["params"][fqn])), fqn
        assert [m["grad_norm"] for m in tiled["metrics"]] == [m["grad_norm"] for m in untiled["metrics"]]
        assert any((tiled["params"][k] != tiled["initial"][k]).any() for k in tiled["params"])


def assert_bitwise(runs: list[dict], others: list[dict]) -> None:
    for got, want in zip(runs, others, strict=True):
        assert [m["grad_norm"] for m in got["metrics"]] == [m["grad_norm"] for m in want["metrics"]]
        assert got["params"].keys() == want["params"].keys()
        for fqn, value in got["params"].items():
            assert np.array_equal(value, want["params"][fqn]), fqn


@pytest.mark.parametrize("stage0,sharded", [("s0_ep1", "s1_ep1"), ("s0_ep2", "s1_ep2"),
                                            ("s0_ep2", "s2_ep2"),
                                            ("fp32_s0_tiledTrue", "fp32_s1_tiledTrue"),
                                            ("bf16_s0_tiledFalse", "bf16_s2_tiledFalse")])
def test_stage0_steps_bit_for_bit_like_the_sharded_stages(w2, stage0, sharded):
    """At W = 2 every reduced gradient is one fp32 sum of two, whatever the collective; stage
    0 then runs the sharded stages' step on whole groups, its grad norm over each rank's own
    partition ranges: the same norms and params, bit for bit."""
    assert_bitwise(by_name(w2, stage0), by_name(w2, sharded))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_process_stages_are_bit_identical(dtype):
    """W = 1, in this process: stages 0, 1 and 2 give the same norms and params bit for bit."""
    runs = {s: train_steps(zcfg(stage=s, dtype=dtype, cap=CAP), 2, steps=2) for s in (0, 1, 2)}
    for stage in (1, 2):
        assert_bitwise([runs[0]], [runs[stage]])
    assert any((runs[0]["params"][k] != runs[0]["initial"][k]).any() for k in runs[0]["params"])


def test_grad_norm_is_invariant_to_ep(w4):
    norms = {ep: [r["metrics"][0]["grad_norm"] for r in by_name(w4, name)]
             for ep, name in ((1, "norm_ep1"), (2, "s2_ep2"), (4, "norm_ep4"))}
    for ep, values in norms.items():
        assert len(set(values)) == 1, f"ranks disagree at ep {ep}: {values}"
        assert rel_err(values[0], norms[1][0]) <= NORM_RTOL, (ep, values[0], norms[1][0])


def test_fp16_overflow_skips_on_every_rank_with_hysteresis(w2):
    runs = by_name(w2, "fp16_overflow")
    for run in runs:  # the inf was injected on the last rank only
        assert [m["skipped"] for m in run["metrics"]] == [True, True, False, False]
        # hysteresis 2: the first overflow keeps 2**8, the second halves it
        assert [m["loss_scale"] for m in run["metrics"]] == [256.0, 128.0, 128.0, 128.0]
        assert run["step_count"] == 2
        assert any((run["params"][k] != run["initial"][k]).any() for k in run["params"])


def test_clipping_is_honoured(w2, single):
    runs = by_name(w2, "clipped")
    assert all(m["grad_norm"] > 0.05 for m in runs[0]["metrics"])  # clipping was active
    for run in runs:
        assert run["probe_err"] is not None and run["probe_err"] <= NORM_RTOL
    assert_close_by_fqn(merged(runs, "params"), single["clipped"]["params"], RTOL["fp32"])
    unclipped = single["ref_w2"]["params"]
    assert max(rel_err(single["clipped"]["params"][k], unclipped[k]) for k in unclipped) > 1e-3


def step_peaks(tiled: bool) -> dict:
    cfg = Config.model_validate(zcfg(stage=2, experts=16, cap=2000, tiled=tiled))
    topo = build_topology([1], num_experts=16)
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
    batch = torch.from_numpy(Batches(make_corpus(None, vocab=32, sources=2, seed=7), seed=3,
                                     dp_rank=0, dp_size=1, global_batch=MICRO,
                                     seq_len=cfg.train.seq_len).next())
    out = engine.train_step([batch])
    shards = [s.shard for s in engine.optimizer.slots]
    return {"peak": out["step_peak_engine_bytes"], "persistent": engine.optimizer.meter.persistent,
            "shards": shards}


def test_tiled_step_peak_is_below_untiled():
    tiled, untiled = step_peaks(True), step_peaks(False)
    assert len(tiled["shards"]) > 16  # many groups
    assert tiled["persistent"] == untiled["persistent"]
    # untiled: every group's fp32 gradient at once; tiled: about one group's (plus AdamW temps)
    assert untiled["peak"] - untiled["persistent"] >= 4 * sum(untiled["shards"])
    assert tiled["peak"] - tiled["persistent"] <= 4 * 3 * max(tiled["shards"])
    assert tiled["peak"] < untiled["peak"]


@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_master_is_the_params_own_range(stage):
    """fp32 in memory keeps no master copy: each slot's master is this rank's range of the
    flat params, so the engine holds 12 B per owned element (grad partition + two moments);
    bf16 keeps a separate fp32 master (14 B)."""
    for dtype, per_element in (("fp32", 12), ("bf16", 14)):
        cfg = Config.model_validate(zcfg(stage=stage, experts=4, cap=CAP, dtype=dtype))
        topo = build_topology([1], num_experts=4)
        engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
        flats = {k.params.untyped_storage().data_ptr() for k in engine.optimizer.kinds}
        shared = [s.master.untyped_storage().data_ptr() in flats for s in engine.optimizer.slots]
        assert all(shared) if dtype == "fp32" else not any(shared), dtype
        owned = sum(s.shard for s in engine.optimizer.slots)
        full_grads = (4 if dtype == "fp32" else 2) * owned if stage == 1 else 0  # W = 1
        assert engine.optimizer.meter.persistent == per_element * owned + full_grads, dtype
