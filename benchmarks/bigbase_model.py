"""A random Qwen3-MoE-shaped Hugging Face folder written tensor by tensor, in bf16, without
ever holding the model: the ``bigbase`` series' 16 B base does not fit in this box's memory.

The tensor names and shapes are those of ``transformers.Qwen3MoeForCausalLM`` built on the
meta device (transformers 5's fused experts: ``mlp.experts.gate_up_proj`` [E, 2F, D] and
``mlp.experts.down_proj`` [E, D, F], which ``moezero import-hf`` and ``from_pretrained`` both
read). Each tensor is filled in chunks of random bf16 values (weights N(0, 0.02²): windows of
one 64 MiB pool of draws, at random starts; norm gains 1 ± 0.02), seeded by its name, and
written with ``pwrite`` into shards of at most ``shard_bytes`` beside ``config.json`` and
``model.safetensors.index.json``. The same seed writes the same bytes.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import torch

from moezero.plan.encoding import safetensors_header

CHUNK_ELEMENTS = 1 << 22  # 8 MiB of bf16 at a time
POOL_ELEMENTS = 1 << 25  # 64 MiB of bf16 weights the chunks are cut from


def qwen3_config(model: dict, vocab_size: int):
    """The ``Qwen3MoeConfig`` of a series size."""
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=model["dim"], intermediate_size=model["ffn_dim"],
        moe_intermediate_size=model["ffn_dim"], num_hidden_layers=model["n_layers"],
        num_attention_heads=model["n_heads"], num_key_value_heads=model["n_kv_heads"],
        head_dim=model["head_dim"], num_experts=model["num_experts"],
        num_experts_per_tok=model["top_k"], norm_topk_prob=True, tie_word_embeddings=False,
        max_position_embeddings=4096, eos_token_id=2, pad_token_id=0, bos_token_id=None,
        dtype="bfloat16")


def shapes_of(config) -> dict[str, tuple[int, ...]]:
    """Every tensor the model saves, by name, from a model on the meta device."""
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def write_model(folder: Path, model: dict, vocab_size: int, *, seed: int = 0,
                shard_bytes: int = 2 << 30) -> int:
    """Write the folder; returns the parameter count."""
    config = qwen3_config(model, vocab_size)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    shapes = shapes_of(config)
    shards = _shards(shapes, shard_bytes)
    weight_map, pool = {}, _pool(seed)
    for i, names in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(folder / name, {n: shapes[n] for n in names}, pool)
        weight_map.update(dict.fromkeys(names, name))
    total = sum(math.prod(s) for s in shapes.values())
    index = {"metadata": {"total_size": 2 * total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def _shards(shapes: dict, shard_bytes: int) -> list[list[str]]:
    out, used = [[]], 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        if out[-1] and used + size > shard_bytes:
            out.append([])
            used = 0
        out[-1].append(name)
        used += size
    return out


def _write_shard(path: Path, shapes: dict, pool: torch.Tensor) -> None:
    entries, cursor = [], 0
    for name, shape in shapes.items():
        entries.append((name, "BF16", shape, cursor, cursor + 2 * math.prod(shape)))
        cursor = entries[-1][4]
    header = safetensors_header({"format": "pt"}, entries)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, header, 0)
        for name, _, shape, begin, _ in entries:
            _write_tensor(fd, len(header) + begin, name, math.prod(shape), pool)
        os.fsync(fd)
    finally:
        os.close(fd)


def _pool(seed: int) -> torch.Tensor:
    """``POOL_ELEMENTS`` random bf16 weights, N(0, 0.02²), the same for a seed."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(POOL_ELEMENTS, generator=gen) * 0.02).to(torch.bfloat16)


def _write_tensor(fd: int, offset: int, name: str, numel: int, pool: torch.Tensor) -> None:
    """A tensor's values: for a norm gain, 1 + N(0, 0.02²) drawn afresh; else windows of
    ``CHUNK_ELEMENTS`` of the pool at random starts (seeded by the name), so writing 16 B
    weights costs a copy per chunk rather than a normal draw per element."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    starts = torch.randint(0, POOL_ELEMENTS - CHUNK_ELEMENTS, (-(-numel // CHUNK_ELEMENTS),),
                           generator=gen).tolist()
    for lo, start in zip(range(0, numel, CHUNK_ELEMENTS), starts, strict=True):
        n = min(CHUNK_ELEMENTS, numel - lo)
        if name.endswith("norm.weight"):
            part = (torch.randn(n, generator=gen) * 0.02 + 1.0).to(torch.bfloat16)
        else:
            part = pool[start:start + n]
        view = memoryview(part.view(torch.uint8).numpy())
        at = offset + 2 * lo
        while view:
            done = os.pwrite(fd, view, at)
            view, at = view[done:], at + done
