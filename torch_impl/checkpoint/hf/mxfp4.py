"""MXFP4 (OCP Microscaling, FP4 E2M1 elements, E8M0 scales), as gpt-oss's hub checkpoints
store their expert weights: ``<name>_blocks`` [..., R, G, 16] uint8 (two 4-bit codes a byte,
the low nibble first) and ``<name>_scales`` [..., R, G] uint8 (a power of two, bias 127),
one scale per block of 32 elements along the last dim. Dequantized to fp32 at import, one
expert's slice at a time, with the same float operations as transformers'
``integrations.mxfp4.convert_moe_packed_tensors`` (a table lookup, then ``ldexp``), so the
result is bit-equal to its fp32 dequantization.
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The eight magnitudes of an FP4 E2M1 code's low three bits; bit 3 is the sign."""
SCALE_BIAS = 127
BLOCK = 32  # elements per scale


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., R, G·32] of ``blocks`` [..., R, G, 16] and ``scales`` [..., R, G].

    Raises:
        ValueError: the shapes do not pair (one scale per 16-byte block).
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)}")
    table = torch.tensor([*E2M1, *(-v for v in E2M1)], dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    low, high = table[(codes & 0x0F).long()], table[(codes >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # element 2i: low nibble of byte i
    exponent = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values, exponent[..., None])
    return out.flatten(-2)
