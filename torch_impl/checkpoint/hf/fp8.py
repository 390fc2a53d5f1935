"""DeepSeek-V3 / Kimi-K2's FP8 block-scaled weights, dequantized while streaming at import
(docs/hf.md, "FP8 weights").

The format (``quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [bm, bn]}``):
a quantized 2-D ``<name>.weight`` [M, N] is ``float8_e4m3fn``, and ``<name>.weight_scale_inv``
[ceil(M/bm), ceil(N/bn)] (fp32) holds one scale per block, so the weight is
``w[i, j] = fp8[i, j] · scale_inv[i // bm, j // bn]``: the fp8 value widened to fp32 (exact),
times the fp32 scale, rounded once, as transformers' ``Fp8Dequantize`` computes it. Tensors
without a ``weight_scale_inv`` beside them (embeddings, norms, the router) are read as they are.
Rows are dequantized as they are read (``HFTensors.read_rows``): one slice of the weight and
its scale rows in memory at a time.
Legend: R rows read, N columns, S scale rows covering them.
"""

from __future__ import annotations

import torch

from moezero.checkpoint.hf.arch import refuse

SCALE_SUFFIX = "_scale_inv"


def block_size(cfg: dict, where: str) -> tuple[int, int] | None:
    """The (rows, cols) block of an FP8 checkpoint's ``quantization_config``, None without one
    (or for gpt-oss's MXFP4, which its family reads); one-line CheckpointError on a
    quantization moezero does not read."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method == "mxfp4" and cfg.get("model_type") == "gpt_oss":
        return None  # gpt-oss's MXFP4 experts: the family's own reader (checkpoint/hf/mxfp4.py)
    if method != "fp8":
        raise refuse(where, "quantization_config.quant_method", method,
                     "moezero reads FP8 block-scaled weights (fp8) here")
    if quant.get("fmt", "e4m3") != "e4m3" or quant.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse(where, "quantization_config", quant, "moezero reads fp8 e4m3 weights with "
                                                          "dynamic activations")
    block = quant.get("weight_block_size") or [128, 128]
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise refuse(where, "quantization_config.weight_block_size", block, "two positive ints")
    return block[0], block[1]


def scale_key(key: str) -> str:
    """``<name>.weight`` -> ``<name>.weight_scale_inv``."""
    return key + SCALE_SUFFIX


def dequantize_rows(fp8_RN: torch.Tensor, scale_SN: torch.Tensor, first_row: int,
                    block: tuple[int, int]) -> torch.Tensor:
    """fp32 rows ``first_row ..`` of a block-scaled weight from their fp8 values ``fp8_RN``
    and the scale rows ``scale_SN`` that cover them (``scale_inv[first_row // bm ..]``)."""
    bm, bn = block
    rows, cols = fp8_RN.shape
    skip = first_row - (first_row // bm) * bm
    per_row = scale_SN.float().repeat_interleave(bm, dim=0)[skip:skip + rows]
    return fp8_RN.float() * per_row.repeat_interleave(bn, dim=1)[:, :cols]


def scale_rows(rows: slice, block: tuple[int, int]) -> slice:
    """The scale rows covering weight rows ``rows`` (start and stop given)."""
    return slice(rows.start // block[0], -(-rows.stop // block[0]))
