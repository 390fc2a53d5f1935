"""The gated DeltaNet kind (``moezero.model.gated_delta``) and the gated attention option against
transformers' Qwen3-Next modules (their torch path: ``torch_chunk_gated_delta_rule`` and the
conv fallback) at fp32, every weight random; and document masks: a packed row equals each
document alone (docs/model.md, "Gated DeltaNet")."""

from __future__ import annotations

import pytest
import torch

from moezero.model.args import ModelArgs
from moezero.model.attention import Attention
from moezero.model.gated_delta import GatedDeltaNet
from moezero.model.packing import document_mask

transformers = pytest.importorskip("transformers")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

TOL = 1e-5
HF = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
          linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=3,
          rms_norm_eps=1e-6, partial_rotary_factor=0.5)
ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 norm_eps=1e-6, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=3,
                 gated_delta_chunk=4, partial_rotary_factor=0.5, qk_norm="head",
                 attn_output_gate=True, rope_theta=10000.0)


def hf_config():
    cfg = transformers.Qwen3NextConfig(**HF)
    cfg._attn_implementation = "eager"
    return cfg


def randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


@pytest.fixture(scope="module")
def delta_pair():
    hf = qwen3_next.Qwen3NextGatedDeltaNet(hf_config(), 0)
    randomize(hf, 1)
    ours = GatedDeltaNet(ARGS)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def inputs(seq: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(2, seq, 32, generator=torch.Generator().manual_seed(seed))


def grads(module, x, out) -> dict[str, torch.Tensor]:
    """The gradients of a random projection of ``out``: the input's (``x``) and each
    parameter's, by name."""
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    names, params = zip(*[("x", x), *module.named_parameters()], strict=True)
    return dict(zip(names, torch.autograd.grad((out * weights).sum(), params), strict=True))


@pytest.mark.parametrize("seq", [1, 7, 13])  # chunks of 4: none fits the chunk size exactly
def test_gated_delta_equals_transformers(delta_pair, seq):
    hf, ours = delta_pair
    x_hf, x = inputs(seq).requires_grad_(), inputs(seq).requires_grad_()
    want, got = hf(x_hf), ours(x)
    assert (got - want).abs().max() <= TOL * want.abs().max()
    got_grads, want_grads = grads(ours, x, got), grads(hf, x_hf, want)
    assert got_grads.keys() == want_grads.keys()
    for name, w in want_grads.items():
        assert (got_grads[name] - w).abs().max() <= TOL * w.abs().max(), name


def test_gated_delta_packed_row_equals_documents_alone(delta_pair):
    _, ours = delta_pair
    lengths = (5, 1, 7)  # a start inside a chunk, a one-token document, one across chunks
    x = inputs(sum(lengths), seed=4)
    labels = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    packed = ours(x[:1], document_mask(labels))
    alone = torch.cat([ours(part) for part in x[:1].split(lengths, dim=1)], dim=1)
    assert (packed - alone).abs().max() <= TOL * alone.abs().max()


def test_gated_attention_equals_transformers():
    cfg = hf_config()
    hf = qwen3_next.Qwen3NextAttention(cfg, 1)
    randomize(hf, 5)
    ours = Attention(ARGS)
    state = {f"w{n[0]}.weight": w for n, w in hf.state_dict().items() if n.endswith("proj.weight")}
    # transformers' QK-norm multiplies by (1 + weight); moezero's RMSNorm by its weight
    state |= {f"{n}.weight": 1 + hf.state_dict()[f"{n}.weight"] for n in ("q_norm", "k_norm")}
    ours.load_state_dict(state)
    x_hf, x = inputs(9).requires_grad_(), inputs(9).requires_grad_()
    rotary = qwen3_next.Qwen3NextRotaryEmbedding(cfg)
    pos = torch.arange(9)[None]
    want = hf(x_hf, rotary(x_hf, pos), attention_mask=_causal(9))[0]
    got = ours(x)
    assert (got - want).abs().max() <= TOL * want.abs().max()
    gx, gx_hf = grads(ours, x, got)["x"], grads(hf, x_hf, want)["x"]
    assert (gx - gx_hf).abs().max() <= TOL * gx_hf.abs().max()


def _causal(seq: int) -> torch.Tensor:
    return torch.full((seq, seq), float("-inf")).triu(1)[None, None]
