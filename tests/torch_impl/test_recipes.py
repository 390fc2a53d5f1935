"""Every shipped recipe (torch_impl/recipes/*.yaml) loads and ``moezero estimate`` runs on it;
the Qwen3-30B-A3B recipes have that model's parameters (counted by hand from its published
config.json) and fit 8 GPUs of 80 GB. Shapes only (meta device): about 12 s in all (the LoRA recipe's 18 k adapted expert projections: 6 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moezero.config import load_config
from moezero.estimate import estimate, format_table

RECIPES = sorted((Path(__file__).resolve().parents[2] / "torch_impl" / "recipes").glob("*.yaml"))
NO_BASE = ["checkpoint.load=null"]  # the recipes name an import-hf output that is not here
GIB = 2**30


def qwen3_30b_a3b_params(lora_r: int = 0) -> tuple[int, int]:
    """(all, LoRA-trained) params of Qwen3-30B-A3B: vocab 151936, hidden 2048, 48 layers, 32
    query and 4 K/V heads of 128 with per-head QK-norm, 128 experts of 768, untied embeddings;
    adapters of rank ``lora_r`` on attention and every expert's three projections."""
    d, q, kv, f, vocab, layers, experts = 2048, 32 * 128, 4 * 128, 768, 151936, 48, 128
    block = 2 * d * q + 2 * d * kv + 2 * 128 + 2 * d + experts * d + experts * 3 * d * f
    adapters = lora_r * (2 * (d + q) + 2 * (d + kv)) + experts * 3 * lora_r * (d + f)
    return 2 * vocab * d + layers * (block + adapters) + d, layers * adapters


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {"default.yaml", "mixtral-8x7b.yaml",
                                        "qwen3-moe-30b-a3b-sft.yaml", "qwen3-moe-30b-a3b-lora.yaml"}


QWEN3 = {"qwen3-moe-30b-a3b-sft": 0, "qwen3-moe-30b-a3b-lora": 16}  # recipe: LoRA rank


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads_and_is_estimated(recipe):
    """Rank 0's estimate; for the Qwen3-30B-A3B recipes also the model's params (trained ones
    with LoRA) and a fit on 8 GPUs of 80 GB (device peak under 70 GiB, host under 512 GiB a
    node)."""
    cfg = load_config(recipe, NO_BASE)
    world = 8 if cfg.model.n_layers > 4 else 2
    est = estimate(cfg, world)
    assert "peak device" in format_table(est)
    if recipe.stem in QWEN3:
        assert load_config(recipe).checkpoint.load and cfg.data.document_mask
        total, trained = qwen3_30b_a3b_params(QWEN3[recipe.stem])
        assert (est.model_numel, est.trained_numel) == (total, trained or total)
        assert est.dtype == "bf16" and est.peak("device") < 70 * GIB, format_table(est)
        assert 8 * est.peak("cpu") < 512 * GIB, format_table(est)

