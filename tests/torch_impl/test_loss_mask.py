"""Loss masks end to end in the engine: the loss is the sum over the global batch's trained
targets over their count, so W and ``grad_accum_steps`` do not change it (fp32), and it equals
that mean computed directly from one forward of the whole batch."""

from __future__ import annotations

import numpy as np
import torch

from moezero.config import Config
from moezero.data import Batches, make_corpus
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.model.packing import Batch
from moezero.train import build_model
from tests.support.compare import assert_close_by_fqn, rel_err
from tests.support.world import run_world
from tests.torch_impl.tolerances import RTOL

ROWS, SEQ, STEPS = 4, 16, 2
TRAINED = (0.1, 0.4, 0.75, 1.0)  # each row's fraction of trained targets: ranks differ


def config(ep: int = 1) -> Config:
    """Aux and z losses off: they are per rank and micro-batch by design (docs/design.md "Semantics: topology, gradients, the step")."""
    cfg = Config()
    cfg.model = cfg.model.model_copy(update={"dim": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 48})
    cfg.train = cfg.train.model_copy(update={"seq_len": SEQ, "steps": STEPS})
    cfg.moe = cfg.moe.model_copy(update={"num_experts": 4, "ep_size": ep, "aux_loss_coef": 0.0,
                                         "z_loss_coef": 0.0})
    cfg.precision.dtype = "fp32"
    return Config.model_validate(cfg.model_dump(by_alias=True))


def global_batch(step: int) -> Batch:
    """Step ``step``'s rows: synthetic tokens, a loss mask trained on ``TRAINED`` of each row,
    three documents per row."""
    corpus = make_corpus(None, vocab=32, sources=2, seed=7)
    tokens = Batches(corpus, global_batch=ROWS, seq_len=SEQ, seed=3, dp_rank=0,
                     dp_size=1).global_batch_at(step)
    rng = np.random.default_rng([11, step])
    mask = rng.random((ROWS, SEQ)) < np.array(TRAINED)[:, None]
    mask[:, 0] = True  # no row without a trained target
    cuts = np.sort(rng.choice(np.arange(1, SEQ), (ROWS, 2), replace=True), axis=1)
    docs = (np.arange(SEQ)[None, :, None] >= cuts[:, None, :]).sum(-1)
    return Batch.of((tokens, mask, docs))


def rows(batch: Batch, lo: int, hi: int) -> Batch:
    return Batch(batch.tokens_BS1[lo:hi], batch.loss_mask_BS[lo:hi], batch.documents_BS[lo:hi])


def run(cfg_data: dict, runs: tuple[tuple[int, int], ...]) -> dict:
    """Per ``(grad_accum_steps, ZeRO stage)``: each step's ce and the params after ``STEPS``
    steps."""
    out = {}
    for accum, stage in runs:
        cfg = Config.model_validate(cfg_data)
        cfg.train.grad_accum_steps = accum
        cfg.zero_optimization.stage = stage
        topo = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
        engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
        per_rank = ROWS // topo.world_size
        per_micro = per_rank // accum
        ces = []
        for step in range(STEPS):
            mine = rows(global_batch(step), topo.rank * per_rank, (topo.rank + 1) * per_rank)
            micro = [rows(mine, i * per_micro, (i + 1) * per_micro) for i in range(accum)]
            ces.append(engine.train_step(micro)["ce"])
        out[accum, stage] = {"ce": ces, "params": {k: p.detach().clone().numpy()
                                            for k, p in engine.full_parameters().items()}}
    return out


def direct_ce(cfg: Config) -> float:
    """Step 0's masked mean from one forward of the whole batch (log-softmax by hand)."""
    topo = build_topology([1], num_experts=cfg.moe.num_experts)
    model, batch = build_model(cfg, topo), global_batch(0)
    with torch.no_grad():
        logits, _ = model(batch.tokens_BS1[:, :-1], batch.documents_BS)
    nll = -logits.double().log_softmax(-1).gather(-1, batch.tokens_BS1[:, 1:, None])[..., 0]
    return (nll[batch.loss_mask_BS].sum() / batch.loss_mask_BS.sum()).item()


def test_w_and_accum_do_not_change_the_masked_loss(tmp_path):
    sharded = ((1, 1), (2, 1), (1, 3))  # (accum, ZeRO stage) at W=2, ep 2
    (single,) = run_world(run, 1, tmp_path, config().model_dump(by_alias=True), ((1, 0), (2, 0)))
    ranks = run_world(run, 2, tmp_path, config(ep=2).model_dump(by_alias=True), sharded)
    want = single[1, 0]
    assert rel_err(want["ce"][0], direct_ce(config())) <= 1e-6
    for key in sharded:
        for r in ranks:
            for got, ce in zip(r[key]["ce"], want["ce"], strict=True):
                assert rel_err(got, ce) <= 1e-6, (key, got, ce)
        merged = {k: v for r in ranks for k, v in r[key]["params"].items()}
        assert_close_by_fqn(merged, want["params"], RTOL["fp32"])
    for got, ce in zip(single[2, 0]["ce"], want["ce"], strict=True):
        assert rel_err(got, ce) <= 1e-6
    assert_close_by_fqn(single[2, 0]["params"], want["params"], RTOL["fp32"])
