"""LoRA adapters in the reference's parameter tree: ``lora_A``/``lora_B`` beside a targeted
projection's weight (``linear`` adds their term). Torch counterpart:
``torch_impl/model/lora.py``.
"""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from moezero.reference.model import ModelConfig

LORA_PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "q_proj", "q_a_proj", "q_b_proj",
                    "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",  # these six: reference/mla.py
                    "in_proj_qkvz", "in_proj_ba", "out_proj")  # these three: gated DeltaNet


def with_lora(cfg: ModelConfig, owner: str, params: dict, stack: tuple[int, ...] = ()) -> dict:
    """``params`` ({proj: {weight: [*stack, out, in], ...}}) with ``lora_A`` [*stack, r, in]
    (uniform ±1/sqrt(in)) and ``lora_B`` [*stack, out, r] (zeros) on the projections
    ``cfg`` targets; the torch init differs only in its random stream."""
    out = dict(params)
    for proj, p in params.items():
        if proj in LORA_PROJECTIONS and cfg.wants_lora(owner, proj):
            *_, o, i = p["weight"].shape
            key = jax.random.key(zlib.crc32(f"{owner}.{proj}".encode()))
            bound = 1.0 / math.sqrt(i)
            out[proj] = {**p, "lora_A": jax.random.uniform(key, (*stack, cfg.lora_r, i),
                                                           jnp.float32, -bound, bound),
                         "lora_B": jnp.zeros((*stack, o, cfg.lora_r), jnp.float32)}
    return out


def linear(p: dict, x: jax.Array, lora_scale: float = 1.0) -> jax.Array:
    """``x @ W.T (+ b)``: torch's Linear layout, the bias only where the params have one;
    plus ``lora_scale · (x @ A.T) @ B.T`` where it has LoRA adapters (``lora_A``/``lora_B``;
    torch: ``moezero.model.lora.LoRALinear``)."""
    y = x @ p["weight"].T
    y = y + p["bias"] if "bias" in p else y
    if "lora_A" in p:
        y = y + lora_scale * ((x @ p["lora_A"].T) @ p["lora_B"].T)
    return y
