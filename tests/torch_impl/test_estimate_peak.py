"""``moezero estimate``'s predicted peak against a rank's measured peak RSS (W = 2, CPU, fp32).

Each rank resets its peak (``/proc/self/clear_refs``), builds the engine through the training
path (``moezero.train.setup``: sharded construction), trains two steps and reads its peak
RSS; the growth over its RSS before the engine is compared with the estimate's peak less
its runtime constant (the process that was already there). The model (~50 M params, state
0.4-0.8 GB per rank) makes the step's transients a large part of the peak, so a missing
gradient bucket or gathered unit would show. The runtime constant itself is measured by the
``estimate`` benchmark series (BENCHMARKS.md, its tiny-model row). The activation figure is
compared with the bytes of every tensor autograd saves in one forward (``saved_tensors_hooks``,
each storage once, the parameters left out).
"""

from __future__ import annotations

import pytest
import torch

from moezero.config import load_config
from moezero.estimate import RUNTIME_BYTES, estimate
from moezero.model.build import config_decoder
from moezero.model.recompute import checkpoint_blocks
from moezero.transients import activation_bytes, kept_activation_bytes
from tests.support.saved import saved_storages
from tests.support.world import run_world
from tests.torch_impl.tolerances import ACTIVATION_RTOL, ESTIMATE_PEAK_RTOL

MODEL = ["model.dim=256", "model.n_layers=4", "model.ffn_dim=1024", "moe.num_experts=16",
         "moe.ep_size=1", "train.micro_batch_size=2", "train.seq_len=64",
         "precision.dtype=fp32", "optimizer.warmup_steps=0"]


def grow(overrides: list[list[str]]) -> list[tuple[int, int]]:
    """Per config on this rank: (rank, growth of peak RSS over the RSS before the engine)."""
    import torch.distributed as dist

    from moezero.telemetry import PeakMemory
    from moezero.train import setup

    memory, out = PeakMemory(torch.device("cpu")), []
    for extra in overrides:
        memory.reset()  # VmHWM := VmRSS
        assert memory.resettable, "cannot reset the peak RSS (/proc/self/clear_refs)"
        before = memory.peak()
        engine, batches = setup(load_config(None, MODEL + extra), torch.device("cpu"))
        for _ in range(2):
            engine.train_step([torch.from_numpy(batches.next())])
        out.append((dist.get_rank(), memory.peak() - before))
        engine.close()
        del engine, batches
    return out


@pytest.mark.parametrize("stages", [["zero_optimization.stage=2"], ["zero_optimization.stage=3"]])
def test_the_estimate_predicts_the_peak(tmp_path, stages):
    configs = [stages]
    for rank_results in run_world(grow, 2, tmp_path, configs):
        for extra, (rank, growth) in zip(configs, rank_results, strict=True):
            est = estimate(load_config(None, MODEL + extra), 2, rank=rank, device="cpu")
            predicted = est.peak("cpu") - RUNTIME_BYTES["cpu"]
            assert abs(growth / predicted - 1) <= ESTIMATE_PEAK_RTOL, (extra, rank, growth, predicted)


ACTIVATION_CASES = [
    ["model.dim=256", "model.ffn_dim=512", "model.n_heads=4"],
    ["model.dim=128", "model.ffn_dim=1024", "model.n_heads=8", "train.seq_len=256"],
    ["model.dim=256", "model.ffn_dim=256", "model.n_heads=8", "model.n_kv_heads=2",
     "model.head_dim=64", "moe.shared_ffn_dim=512"],
    ["model.dim=256", "model.ffn_dim=256", "model.n_heads=8", "model.n_kv_heads=2",
     "precision.dtype=bf16"],
    # checkpointing: every block keeps its input; blocks 0 and 2 of 4 (and bf16)
    ["model.dim=256", "model.ffn_dim=512", "model.n_heads=4", "activation_checkpointing.enabled=true"],
    ["model.dim=256", "model.ffn_dim=512", "model.n_heads=4", "activation_checkpointing.enabled=true",
     "activation_checkpointing.every_n_layers=2", "precision.dtype=bf16"],
    # dense MLP layers (model.first_k_dense) wider than the experts, alone and checkpointed
    ["model.dim=256", "model.ffn_dim=512", "model.n_heads=4", "model.first_k_dense=3",
     "model.dense_ffn_dim=2048"],
    ["model.dim=256", "model.ffn_dim=512", "model.n_heads=4", "model.first_k_dense=3",
     "model.dense_ffn_dim=2048", "precision.dtype=bf16", "activation_checkpointing.enabled=true",
     "activation_checkpointing.every_n_layers=2"],
    # Qwen3-Next: gated DeltaNet in 3 of 4 layers (its chunk tiles and state), gated attention
    ["model.dim=256", "model.ffn_dim=256", "model.n_heads=4", "model.head_dim=64",
     "model.attn_output_gate=true", "model.gated_delta_layers=[0,1,2]",
     "model.linear_num_key_heads=2", "model.linear_num_value_heads=4",
     "model.linear_key_head_dim=32", "model.linear_value_head_dim=32",
     "model.gated_delta_chunk=32"],
    # a big vocabulary, its logits a chunk at a time (model.loss_chunk_tokens): none kept
    ["model.dim=128", "model.ffn_dim=256", "model.n_heads=4", "model.vocab_size=8192",
     "activation_checkpointing.enabled=true", "model.loss_chunk_tokens=64"],
]


def saved_bytes(cfg) -> int:
    """Bytes of the tensors autograd keeps for backward in one forward and loss (each storage
    once; parameters excluded)."""
    dtype = torch.bfloat16 if cfg.precision.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model = config_decoder(cfg, where="cpu", adapters=False, init=False).to(dtype)
    if cfg.activation_checkpointing.enabled:
        checkpoint_blocks(model, cfg.activation_checkpointing.every_n_layers)
    tokens = torch.randint(0, cfg.model.vocab_size,
                           (cfg.train.micro_batch_size, cfg.train.seq_len + 1))
    with saved_storages(model) as seen:
        model.loss(tokens)
    return sum(seen.values())


@pytest.mark.parametrize("extra", ACTIVATION_CASES)
def test_the_activation_figure_counts_what_autograd_saves(extra):
    cfg = load_config(None, ["moe.ep_size=1", "train.micro_batch_size=4", "train.seq_len=128",
                             "precision.dtype=fp32", *extra])
    itemsize = 2 if cfg.precision.dtype == "bf16" else 4
    saved, predicted = saved_bytes(cfg), kept_activation_bytes(cfg, itemsize)
    assert abs(saved / predicted - 1) <= ACTIVATION_RTOL, (extra, saved, predicted)


def test_checkpointing_adds_the_saved_activations_of_one_recomputed_block():
    """Backward recomputes one checkpointed block at a time: the peak adds what one block's
    forward saves (measured on a block alone) to what the checkpointed forward kept."""
    over = ["model.dim=256", "model.ffn_dim=512", "model.n_heads=4", "train.micro_batch_size=4",
            "train.seq_len=128", "precision.dtype=fp32", "moe.ep_size=1"]
    plain = load_config(None, over)
    ac = load_config(None, [*over, "activation_checkpointing.enabled=true"])
    torch.manual_seed(0)
    block = config_decoder(plain, where="cpu", init=False).layers[0]
    with saved_storages(block) as seen:
        block(torch.randn(4, 128, 256, requires_grad=True))
    extra = activation_bytes(ac, 4) - kept_activation_bytes(ac, 4)
    assert abs(extra / sum(seen.values()) - 1) <= ACTIVATION_RTOL, (extra, sum(seen.values()))
    assert activation_bytes(plain, 4) == kept_activation_bytes(plain, 4)
