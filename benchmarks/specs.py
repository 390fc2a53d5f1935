"""What is benchmarked: the configurations, as plain data (JSON-serialisable dicts).

Add a row by adding one line to a list below, e.g. ``("moezero stage 3", {...: 3})``.
A configuration the engine or config rejects is reported as 'not supported yet', not fatal.
"""

from __future__ import annotations

MOEZERO_CONFIGS: list[tuple[str, dict]] = [
    ("moezero stage 0", {"zero_optimization.stage": 0}),
    ("moezero stage 1", {"zero_optimization.stage": 1}),
    ("moezero stage 2", {"zero_optimization.stage": 2}),
]
"""moezero rows: (name, dotted config overrides on top of the shared model below)."""

PEER_CONFIGS: list[tuple[str, str, dict]] = [
    ("FSDP2 + DCP", "fsdp2", {}),
    ("DeepSpeed ZeRO-2", "deepspeed", {"stage": 2}),
]
"""Peer rows: (name, system, system options)."""

SWEEP_EXPERTS = (8, 16, 32)
"""Experts per MoE layer for the per-rank memory sweep."""

SWEEP_SYSTEMS: list[tuple[str, str, dict]] = [
    ("moezero stage 0", "moezero", {"zero_optimization.stage": 0}),
    ("moezero stage 2", "moezero", {"zero_optimization.stage": 2}),
    ("FSDP2 + DCP", "fsdp2", {}),
]
"""Rows of the sweep (names as in the lists above, so the main runs give the base point)."""

TARGET_CONFIG = "moezero stage 2"
"""The moezero configuration the issue's targets name (the CLI default once it lands)."""

WORLD_SIZE = 2

SIZES = {
    "quick": {"model": {"vocab_size": 256, "dim": 128, "n_layers": 2, "n_heads": 4,
                        "ffn_dim": 256, "num_experts": 8, "top_k": 2, "ep_size": 2},
              "train": {"micro_batch_size": 4, "seq_len": 128, "lr": 3e-3, "seed": 0,
                        "warmup": 3, "timed": 8},
              "repeats": 3, "dd_mib": 256, "memcpy_mib": 256},
    "full": {"model": {"vocab_size": 256, "dim": 256, "n_layers": 4, "n_heads": 4,
                       "ffn_dim": 512, "num_experts": 8, "top_k": 2, "ep_size": 2},
             "train": {"micro_batch_size": 8, "seq_len": 128, "lr": 3e-3, "seed": 0,
                       "warmup": 5, "timed": 20},
             "repeats": 5, "dd_mib": 1024, "memcpy_mib": 512},
}
"""Shared model and loop per mode. ``ep_size`` applies to moezero and DeepSpeed (expert
parallel); FSDP2 shards every parameter instead and runs all experts on each rank."""


def run_spec(name: str, system: str, options: dict, size: dict, *, experts: int | None = None,
             checkpoint: bool = True, series: str = "main") -> dict:
    """One run's full description, handed to ``benchmarks.worker`` as JSON."""
    model = dict(size["model"])
    if experts is not None:
        model["num_experts"] = experts
    return {"name": name, "system": system, "options": dict(options), "model": model,
            "train": dict(size["train"]), "checkpoint": checkpoint, "series": series,
            "world_size": WORLD_SIZE}


def main_specs(size: dict) -> list[dict]:
    """The configurations compared side by side, in the order each round runs them."""
    specs = [run_spec(name, "moezero", overrides, size) for name, overrides in MOEZERO_CONFIGS]
    specs += [run_spec(name, system, opts, size) for name, system, opts in PEER_CONFIGS]
    return specs


def sweep_specs(size: dict) -> list[dict]:
    """Memory-vs-experts runs not already covered by the main runs (those use the base E)."""
    base = size["model"]["num_experts"]
    return [run_spec(name, system, opts, size, experts=e, checkpoint=False, series="sweep")
            for e in SWEEP_EXPERTS if e != base for name, system, opts in SWEEP_SYSTEMS]
