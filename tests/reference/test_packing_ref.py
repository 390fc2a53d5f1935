"""Reference document masks and loss masks (``moezero.reference.model``): each document of a
packed row computes what it computes alone; masked targets count for nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moezero.reference.model import (
    ModelConfig,
    document_layout,
    forward,
    init_params,
    loss_fn,
)

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                  num_experts=4, top_k=2, qk_norm="head")
LENGTHS = [(5, 7, 4), (16,)]


def _rows():
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 16))
    docs = np.stack([np.repeat(np.arange(len(r)), r) for r in LENGTHS])
    return jnp.asarray(tokens), jnp.asarray(docs)


def test_layout_positions_restart_and_blocks_are_causal():
    layout = document_layout(jnp.asarray([[7, 7, 7, 2, 2, 7]]))
    assert layout.positions_BS.tolist() == [[0, 1, 2, 0, 1, 0]]
    allowed = np.asarray(layout.allowed_BSS[0]).astype(int).tolist()
    assert allowed[4] == [0, 0, 0, 1, 1, 0] and allowed[5] == [0, 0, 0, 0, 0, 1]


def test_packed_logits_equal_each_document_alone():
    params = init_params(CFG, jax.random.PRNGKey(0))
    tokens, docs = _rows()
    packed, _ = forward(params, tokens, CFG, documents_BS=docs)
    plain, _ = forward(params, tokens, CFG)
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            alone, _ = forward(params, tokens[b:b + 1, start:start + n], CFG)
            np.testing.assert_allclose(packed[b, start:start + n], alone[0], rtol=0, atol=1e-5)
            start += n
    assert np.abs(np.asarray(plain[0, 5:] - packed[0, 5:])).max() > 1e-3


def test_masked_targets_have_no_gradient():
    params = init_params(CFG, jax.random.PRNGKey(1))
    rng = np.random.default_rng(2)
    batch = rng.integers(0, CFG.vocab_size, (4, 17))
    mask = rng.random((4, 16)) < 0.5
    mask[:, -1] = False  # the last target is no input: perturbing it changes targets only
    other = batch.copy()
    other[:, -1] = (other[:, -1] + 1 + rng.integers(0, 60, 4)) % CFG.vocab_size
    grad = jax.grad(lambda p, b: loss_fn(p, b, CFG, loss_mask_BS=jnp.asarray(mask))[0])
    a, b = grad(params, jnp.asarray(batch)), grad(params, jnp.asarray(other))
    assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool((x == y).all()), a, b)))
