"""RoPE against transformers' own: full and partial rotary (``model.partial_rotary_factor``,
GLM-4.5's 0.5 and Qwen3-Next's 0.25), positions 0..S-1 and per-document positions."""

from __future__ import annotations

import pytest
import torch

from moezero.model.attention import rope

transformers = pytest.importorskip("transformers")
from transformers.models.glm4_moe import modeling_glm4_moe as glm  # noqa: E402


def hf_rope(x_BSHK: torch.Tensor, factor: float, theta: float,
            positions_BS: torch.Tensor) -> torch.Tensor:
    """transformers' GLM-4.5 rotary embedding applied to x (as queries)."""
    cfg = transformers.Glm4MoeConfig(head_dim=x_BSHK.shape[-1], hidden_size=64,
                                     num_attention_heads=x_BSHK.shape[2],
                                     partial_rotary_factor=factor, rope_theta=theta)
    cfg.rope_parameters["partial_rotary_factor"] = factor
    cfg.rope_parameters["rope_theta"] = theta
    cos, sin = glm.Glm4MoeRotaryEmbedding(cfg)(x_BSHK, positions_BS)
    q_BHSK = x_BSHK.transpose(1, 2)
    out, _ = glm.apply_rotary_pos_emb(q_BHSK, q_BHSK, cos, sin)
    return out.transpose(1, 2)


@pytest.mark.parametrize("factor, head", [(1.0, 16), (0.5, 24), (0.25, 32)])
def test_rope_equals_transformers(factor, head):
    gen = torch.Generator().manual_seed(int(factor * 100) + head)
    x = torch.randn(2, 13, 3, head, generator=gen)
    positions = torch.tensor([list(range(13)), [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4]])
    theirs = hf_rope(x, factor, 5000.0, positions)
    mine = rope(x, 5000.0, positions, int(head * factor))
    assert (mine - theirs).abs().max().item() <= 1e-5
    plain = rope(x, 5000.0, None, int(head * factor))
    assert torch.equal(plain[0], mine[0])  # positions 0..S-1 are the default
    assert torch.equal(mine[..., int(head * factor):], x[..., int(head * factor):])


def test_families_without_partial_rotary_refuse_it_in_one_line():
    from moezero.checkpoint.hf.arch import Arch
    from moezero.checkpoint.hf.families import family_for
    from moezero.plan.store import CheckpointError

    arch = Arch(64, 32, 2, 4, 48, 1e4, 1e-6, 4, 2, 2, 8, partial_rotary_factor=0.5)
    with pytest.raises(CheckpointError, match=r"model.partial_rotary_factor=0.5 cannot be "
                                              r"exported as Hugging Face mixtral"):
        family_for(arch)
