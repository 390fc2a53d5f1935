"""``moezero estimate`` with multi-head latent attention (``model.attention: mla``): its
parameters counted by hand from the shapes of transformers' DeepseekV3Attention, its
activations (the latents, their norms, the padded heads) against the bytes autograd saves
(fp32 and bf16, with and without a query latent), and the FLOPs per token."""

from __future__ import annotations

import pytest

from moezero.config import load_config
from moezero.estimate import estimate
from moezero.model.args import model_args
from moezero.telemetry import flops_per_token
from moezero.transients import kept_activation_bytes
from tests.torch_impl.test_estimate_peak import saved_bytes
from tests.torch_impl.tolerances import ACTIVATION_RTOL

D, H, L, C, N, R, V, E, F, VOCAB = 64, 4, 2, 32, 16, 8, 12, 4, 48, 96
BASE = [f"model.dim={D}", f"model.n_heads={H}", f"model.n_layers={L}", f"model.ffn_dim={F}",
        f"model.vocab_size={VOCAB}", f"moe.num_experts={E}", "moe.top_k=2", "moe.ep_size=1",
        "data.synthetic_vocab=32", "train.micro_batch_size=2", "train.seq_len=64"]
MLA = ["model.attention=mla", f"model.kv_lora_rank={C}", f"model.qk_nope_head_dim={N}",
       f"model.qk_rope_head_dim={R}", f"model.v_head_dim={V}"]


def mla_params(q_rank: int | None, bias: bool) -> int:
    """One layer's MLA parameters, from the shapes of DeepseekV3Attention's modules."""
    q = D * H * (N + R) if q_rank is None else D * q_rank + q_rank + q_rank * H * (N + R)
    kv = D * (C + R) + C + C * H * (N + V)
    o = H * V * D
    biases = (q_rank or 0) + (C + R) + D if bias else 0
    return q + kv + o + biases


@pytest.mark.parametrize(("q_rank", "bias"), [(None, False), (40, True)])
def test_estimate_counts_mla_parameters_by_hand(q_rank, bias):
    extra = ([f"model.q_lora_rank={q_rank}"] if q_rank else []) + \
        (["model.attn_bias=all"] if bias else [])
    est = estimate(load_config(None, BASE + MLA + extra), 1, device="cpu")
    gqa = estimate(load_config(None, BASE), 1, device="cpu")
    per_layer_gqa = 4 * D * D  # wq, wk, wv, wo at K = D / H
    assert est.model_numel - gqa.model_numel == L * (mla_params(q_rank, bias) - per_layer_gqa)
    everything_else = VOCAB * D * 2 + D + L * (2 * D + E * D + E * 3 * D * F)
    assert est.model_numel == everything_else + L * mla_params(q_rank, bias)


@pytest.mark.parametrize("extra", [
    [], ["model.q_lora_rank=40"], ["precision.dtype=bf16"],
    ["model.q_lora_rank=40", "precision.dtype=bf16", "model.rope_interleave=false"],
    ["model.v_head_dim=40"],  # V > Q: the queries and keys are the padded ones
])
def test_the_mla_activation_figure_counts_what_autograd_saves(extra):
    cfg = load_config(None, [*BASE, *MLA, "precision.dtype=fp32", *extra])
    itemsize = 2 if cfg.precision.dtype == "bf16" else 4
    saved, predicted = saved_bytes(cfg), kept_activation_bytes(cfg, itemsize)
    assert abs(saved / predicted - 1) <= ACTIVATION_RTOL, (extra, saved, predicted)


def test_flops_per_token_counts_mla_projections_and_scores():
    args = model_args(load_config(None, BASE + MLA + ["model.q_lora_rank=40"]))
    attn = D * 40 + 40 * H * (N + R) + D * (C + R) + C * H * (N + V) + H * V * D
    active = L * (attn + 2 * 3 * D * F + D * E) + VOCAB * D
    assert flops_per_token(args, 64) == 6 * active + 6 * L * H * (N + R + V) * 64
