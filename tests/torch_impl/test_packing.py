"""Packed rows on the torch side (``moezero.model.packing``): document masks make each document
of a packed row compute what it computes alone; loss masks keep masked targets out of the loss
and its gradient."""

from __future__ import annotations

import pytest
import torch

from moezero.model.build import build_decoder
from moezero.model.decoder import Decoder, ModelArgs
from moezero.model.materialize import KeyedInit
from moezero.model.packing import document_mask
from moezero.model.recompute import checkpoint_blocks

ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                 num_experts=4, top_k=2, qk_norm="head")  # dropless: tokens route alone
LENGTHS = [(5, 7, 4), (16,), (1, 9, 6)]  # documents of each row, 16 tokens per row


def _model() -> Decoder:
    return build_decoder(ARGS, where="cpu", init=KeyedInit(seed=3)).eval()


def _rows(seed: int = 0):
    """Tokens [3, 16] and document labels [3, 16] (labels repeat across rows on purpose)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, ARGS.vocab_size, (len(LENGTHS), 16), generator=gen)
    docs = torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(row)])
                        for row in LENGTHS])
    return tokens, docs


def test_document_mask_positions_restart_and_blocks_are_causal():
    mask = document_mask(torch.tensor([[7, 7, 7, 2, 2, 7]]))
    assert mask.positions_BS.tolist() == [[0, 1, 2, 0, 1, 0]]
    allowed = mask.allowed_B1SS[0, 0].int().tolist()
    assert allowed[2] == [1, 1, 1, 0, 0, 0]
    assert allowed[4] == [0, 0, 0, 1, 1, 0]
    assert allowed[5] == [0, 0, 0, 0, 0, 1]  # label 7 again: a new document


def test_packed_logits_equal_each_document_alone():
    model, (tokens, docs) = _model(), _rows()
    with torch.no_grad():
        packed, _ = model(tokens, docs)
        unmasked, _ = model(tokens)
        for b, row in enumerate(LENGTHS):
            start = 0
            for n in row:
                alone, _ = model(tokens[b:b + 1, start:start + n])
                torch.testing.assert_close(packed[b, start:start + n], alone[0],
                                           rtol=0, atol=1e-5)
                start += n
    # Without the mask the later documents read the earlier ones: the test can tell.
    assert (unmasked[0, 5:] - packed[0, 5:]).abs().max() > 1e-3


def test_one_document_per_row_equals_no_mask():
    model, (tokens, _) = _model(), _rows()
    with torch.no_grad():
        plain, _ = model(tokens)
        masked, _ = model(tokens, torch.zeros_like(tokens))
    torch.testing.assert_close(masked, plain, rtol=0, atol=1e-6)


def _grads(model: Decoder, batch, mask, divisor=None) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss, parts = model.loss(batch, loss_mask_BS=mask, divisor=divisor)
    loss.backward()
    return parts["ce"].item(), {k: p.grad.clone() for k, p in model.named_parameters()
                                if p.grad is not None}


def test_masked_targets_contribute_nothing_to_the_gradient():
    # Every target but a row's last is also the next input; so the perturbed masked targets
    # are the last ones, which no input reads: only the targets change.
    model = _model().train()
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, ARGS.vocab_size, (8, 17), generator=gen)
    mask = torch.rand(8, 16, generator=gen) < 0.5
    mask[:, -1] = False
    other = batch.clone()
    other[:, -1] = (other[:, -1] + torch.randint(1, ARGS.vocab_size, (8,), generator=gen)) \
        % ARGS.vocab_size
    assert (other[:, -1] != batch[:, -1]).all()
    ce_a, grads_a = _grads(model, batch, mask)
    ce_b, grads_b = _grads(model, other, mask)
    assert ce_a == ce_b
    assert grads_a.keys() == grads_b.keys()
    for fqn, g in grads_a.items():
        assert torch.equal(g, grads_b[fqn]), fqn


@pytest.mark.parametrize("divisor", [None, 5.0])
def test_masked_loss_is_the_sum_over_trained_targets_over_the_divisor(divisor):
    model = _model()
    gen = torch.Generator().manual_seed(2)
    batch = torch.randint(0, ARGS.vocab_size, (2, 17), generator=gen)
    mask = torch.rand(2, 16, generator=gen) < 0.4
    with torch.no_grad():
        logits, _ = model(batch[:, :-1])
        _, parts = model.loss(batch, loss_mask_BS=mask, divisor=divisor)
    nll = -logits.double().log_softmax(-1).gather(-1, batch[:, 1:, None])[..., 0]
    want = nll[mask].sum() / (mask.sum() if divisor is None else divisor)
    assert abs(parts["ce"].item() - want.item()) < 1e-5
    assert parts["trained"].item() == mask.sum().item()


def test_recomputed_blocks_see_the_document_mask():
    """Activation checkpointing passes the mask to the recomputed blocks: bit-identical grads."""
    tokens, docs = _rows(4)
    batch = torch.cat([tokens, tokens[:, :1]], dim=1)
    mask = torch.ones(len(LENGTHS), 16, dtype=torch.bool)
    grads = []
    for recompute in (False, True):
        model = _model().train()
        if recompute:
            checkpoint_blocks(model)
        loss, _ = model.loss(batch, loss_mask_BS=mask, documents_BS=docs)
        loss.backward()
        grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for fqn, g in grads[0].items():
        assert torch.equal(g, grads[1][fqn]), fqn
