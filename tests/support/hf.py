"""Writing a transformers model to a folder as the Hub would hold it (tests of import-hf)."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file


def save_hf(model, path: Path, fused: bool = False, shard: str = "50KB") -> Path:
    """``save_pretrained`` in shards of ``shard`` with an index (per-expert tensors on disk), or
    the fused in-memory state dict of transformers 5 as one ``model.safetensors``."""
    if not fused:
        model.save_pretrained(path, max_shard_size=shard)
        return path
    model.config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path
