"""``moezero estimate`` for fine-tuning: frozen parameters (``train.freeze``), LoRA adapters
(``peft``) and the document mask (``data.document_mask``).

Expectations are worked out by hand from the small model's shapes (dim 32, 2 layers of 2 heads
of 16, 4 experts of width 48, vocab 256): a frozen parameter costs its weight in the compute
dtype only; a trained one (an adapter) its weight, its gradient and the fp32 master and
moments. The engine itself is compared with the estimate on the same configs (its
``MemoryMeter`` and flat buffers, as tests/torch_impl/test_estimate.py does). The document mask
is compared with the bytes autograd saves (tests/support/saved.py). About 3 s in all.
"""

from __future__ import annotations

import torch

from moezero.config import Config, load_config
from moezero.estimate import estimate
from moezero.model.build import config_decoder
from moezero.transients import kept_activation_bytes
from tests.support.saved import saved_storages
from tests.torch_impl.test_estimate import case, check, measure

D, LAYERS, EXPERTS, F, VOCAB, R = 32, 2, 4, 48, 256, 4
ATTN_ADAPTERS = LAYERS * 4 * R * (D + D)  # wq, wk, wv, wo: A [r, 32] and B [32, r] each
EXPERT_WEIGHTS = LAYERS * EXPERTS * 3 * D * F  # w1, w3 [48, 32], w2 [32, 48]
BASE = 2 * VOCAB * D + LAYERS * (4 * D * D + 2 * D + EXPERTS * D) + EXPERT_WEIGHTS + D


def lora(stage: int, **kw) -> dict:
    cfg = case(stage, cap=None, **kw)
    cfg["peft"] = {"method": "lora", "r": R, "alpha": 8.0, "targets": ["attn"]}
    return cfg


def test_the_small_model_has_the_shapes_counted_by_hand():
    assert sum(p.numel() for p in config_decoder(Config.model_validate(case(2)), adapters=False).parameters()) \
        == BASE


def test_lora_counts_the_base_as_weights_and_the_adapters_as_trained():
    """Stage 2, fp32, W = 1: base and adapters in the flat params (4 B each); gradients of the
    adapters only (4 B); the moments of the adapters only (the master is the params' range)."""
    est = estimate(Config.model_validate(lora(2)), 1, device="cpu")
    assert est.get("params", "cpu") == 4 * (BASE + ATTN_ADAPTERS)
    assert est.get("grads", "cpu") == 4 * ATTN_ADAPTERS
    assert est.get("optimizer", "cpu") == 8 * ATTN_ADAPTERS
    assert est.model_numel == BASE + ATTN_ADAPTERS and est.local_numel == ATTN_ADAPTERS


def test_lora_at_stage_3_in_bf16_on_a_gpu():
    """bf16 param shards of base and adapters on the device (2 B), the adapters' bf16 gradient
    partition, their fp32 master and moments offloaded to the host (12 B)."""
    est = estimate(Config.model_validate(lora(3, dtype="bf16", optim="cpu")), 1)
    assert est.get("params", "device") == 2 * (BASE + ATTN_ADAPTERS)
    assert est.get("grads", "device") == 2 * ATTN_ADAPTERS
    assert est.get("optimizer", "cpu") == 12 * ATTN_ADAPTERS
    assert est.tier_total("cpu") == 12 * ATTN_ADAPTERS


def test_freeze_keeps_the_optimizer_state_of_the_trained_params_only():
    cfg = case(0, cap=None)
    cfg["train"]["freeze"] = ["*", "!*.experts.*"]
    est = estimate(Config.model_validate(cfg), 1, device="cpu")
    assert est.get("params", "cpu") == 4 * BASE
    assert est.get("grads", "cpu") == 4 * EXPERT_WEIGHTS
    assert est.get("optimizer", "cpu") == 8 * EXPERT_WEIGHTS


def test_the_estimate_equals_the_engine_with_frozen_params_and_adapters():
    frozen = case(1, cap=None)
    frozen["train"]["freeze"] = ["*.attn.*"]
    cases = [lora(0), lora(2), lora(3), lora(3, dtype="bf16"), frozen]
    check(cases, [measure(cases)], 1)


def saved_bytes(cfg: Config, documents: bool) -> int:
    torch.manual_seed(0)
    model = config_decoder(cfg, where="cpu", adapters=False, init=False)
    b, s = cfg.train.micro_batch_size, cfg.train.seq_len
    docs = torch.arange(s).div(s // 4, rounding_mode="floor").expand(b, s) if documents else None
    with saved_storages(model) as seen:
        model(torch.randint(0, cfg.model.vocab_size, (b, s)), docs)
    return sum(seen.values())


def test_the_document_mask_adds_what_attention_saves():
    """On CPU the boolean [B, 1, S, S] mask is kept once and each layer's attention keeps it as
    an additive mask in the compute dtype for its backward (fp32, 2 layers, B 2, S 256)."""
    over = ["model.dim=64", "model.n_layers=2", "model.n_heads=2", "moe.ep_size=1",
            "train.micro_batch_size=2", "train.seq_len=256", "precision.dtype=fp32"]
    plain, masked = load_config(None, over), load_config(None, [*over, "data.document_mask=true"])
    extra = kept_activation_bytes(masked, 4) - kept_activation_bytes(plain, 4)
    assert extra == 2 * 256 * 256 * (1 + 2 * 4)  # B x S^2 x (1 B + layers x 4 B), by hand
    assert saved_bytes(plain, True) - saved_bytes(plain, False) == extra
