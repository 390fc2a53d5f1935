"""``model.loss_chunk_tokens`` (``moezero.model.head``): the LM head's cross-entropy a chunk of
tokens at a time equals torch's whole-logits cross-entropy (loss and gradients, masked or not,
chunks that do not divide the tokens), in a decoder and at ZeRO stage 3, where the head is one
gather unit used once per pass (equal to stage 2 bit for bit, with and without the split dense
groups that make the head its own unit, and with ``zero_optimization.prefetch_max_bytes``
keeping the big units from being gathered ahead).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moezero.model.head import ChunkedCrossEntropy, Head
from moezero.model.packing import IGNORE
from tests.support.world import run_world
from tests.torch_impl.test_stage3 import run_cases
from tests.torch_impl.test_zero import zcfg


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_equal_the_whole_cross_entropy(chunk, dtype):
    gen = torch.Generator().manual_seed(chunk)
    x = torch.randn(3, 13, 24, generator=gen).to(dtype).requires_grad_()
    head = Head(24, 40, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(40, 24, generator=gen))
    targets = torch.randint(0, 40, (3, 13), generator=gen)
    targets[0, :4] = IGNORE  # masked targets: no loss, no gradient
    want = F.cross_entropy(head(x).float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                           reduction="sum")
    want_dx, want_dw = torch.autograd.grad(want * 0.37, [x, head.weight])
    got = head(x, targets, chunk)
    got_dx, got_dw = torch.autograd.grad(got * 0.37, [x, head.weight])
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(got_dx, want_dx, **tol)
    torch.testing.assert_close(got_dw, want_dw, **tol)
    assert got_dw.dtype == dtype and torch.all(got_dx[0, :4] == 0)  # masked rows


def test_a_frozen_head_gets_no_weight_gradient():
    head = Head(8, 11, bias=False).requires_grad_(False)
    x = torch.randn(6, 8, requires_grad=True)
    loss = ChunkedCrossEntropy.apply(x, head.weight, torch.arange(6), 4)
    loss.backward()
    assert x.grad is not None and head.weight.grad is None


LIMIT = 20_000  # bytes: the tiny model's blocks and routers are gathered ahead, not its experts


def _cases() -> dict:
    out = {}
    for by_layer in (False, True):
        for stage in (2, 3):
            cfg = zcfg(stage=stage, ep=2)
            cfg["model"]["loss_chunk_tokens"] = 7
            cfg["moe"]["split_dense_by_layer"] = by_layer
            out[f"s{stage}_layer{int(by_layer)}"] = (cfg, 3)
    limited = zcfg(stage=3, ep=2)
    limited["model"]["loss_chunk_tokens"] = 7
    limited["moe"]["split_dense_by_layer"] = True
    limited["zero_optimization"]["prefetch_max_bytes"] = LIMIT
    out["s3_limit"] = (limited, 3)
    out["whole"] = (zcfg(stage=2, ep=2), 3)
    return out


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    return run_world(run_cases, 2, tmp_path_factory.mktemp("head"), _cases(), timeout_s=300)


def test_stage_3_with_a_chunked_head_equals_stage_2_bit_for_bit(w2):
    for rank in w2:
        for layer in (0, 1):
            s2, s3 = rank[f"s2_layer{layer}"], rank[f"s3_layer{layer}"]
            assert s3["losses"] == s2["losses"], layer
            for fqn, value in s2["params"].items():
                assert np.array_equal(s3["params"][fqn], value), (layer, fqn)


def test_only_units_within_the_prefetch_limit_are_gathered_ahead_same_numbers(w2):
    for rank in w2:
        ahead, unit_bytes = rank["s3_limit"]["ahead"]
        assert ahead == [b <= LIMIT for b in unit_bytes] and any(ahead) and not all(ahead)
        assert all(rank["s3_layer1"]["ahead"][0])  # no limit: every unit
        assert rank["s3_limit"]["losses"] == rank["s2_layer1"]["losses"]
        for fqn, value in rank["s2_layer1"]["params"].items():
            assert np.array_equal(rank["s3_limit"]["params"][fqn], value), fqn


def test_a_chunked_run_trains_like_the_whole_logits_run(w2):
    for rank in w2:
        whole, chunked = rank["whole"], rank["s2_layer0"]
        np.testing.assert_allclose(chunked["losses"], whole["losses"], rtol=1e-5)
        for fqn, value in whole["params"].items():
            np.testing.assert_allclose(chunked["params"][fqn], value, rtol=1e-4, atol=1e-6)
