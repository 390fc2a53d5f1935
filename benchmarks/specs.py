"""What is benchmarked: the configurations, as plain data (JSON-serialisable dicts).

Add a row by adding one line to a list below, e.g. ``("moezero stage 3", {...: 3})``.
A configuration the engine or config rejects is reported as 'not supported yet', not fatal.
A string option may name ``{work}``: the run's work directory (e.g. an NVMe swap folder).

Series (each run's ``series``): ``main`` (the compared configurations, round by round),
``sweep`` (per-rank memory vs experts), ``tiled`` (tiled vs untiled step) and ``state``
(stages vs FSDP2, and per-rank memory vs W) on a model whose optimizer state dominates,
``ckpt`` (checkpoint save/load of a few-hundred-MB model), ``grouped`` (grouped-GEMM experts
vs the per-expert loop on one MoE layer, in this process: ``benchmarks.grouped``), ``data``
(``prepare-data`` vs the tokenizer's own batch encoding on a generated jsonl corpus of
``size["data_mb"]`` MB; ``benchmarks.data_prep``; full mode or ``--series data`` only),
``collectives`` (collectives per step against the number of optimizer groups, bucketed vs
per-group all-gathers), ``estimate`` (``moezero estimate`` against each rank's measured peak,
stages 0-3 and offload none/cpu/nvme, plus a tiny model measuring the runtime).
"""

from __future__ import annotations

import json

MOEZERO_CONFIGS: list[tuple[str, dict]] = [
    ("moezero stage 0", {"zero_optimization.stage": 0}),
    ("moezero stage 1", {"zero_optimization.stage": 1}),
    ("moezero stage 2", {"zero_optimization.stage": 2}),
]
"""moezero rows: (name, dotted config overrides on top of the shared model below)."""

NVME_CONFIG = "moezero stage 3 + nvme/nvme"
NVME_OVERRIDES = {"zero_optimization.stage": 3,
                  "zero_optimization.offload_optimizer.device": "nvme",
                  "zero_optimization.offload_optimizer.nvme_path": "{work}/nvme",
                  "zero_optimization.offload_param.device": "nvme",
                  "zero_optimization.offload_param.nvme_path": "{work}/nvme"}
"""ZeRO-3 with optimizer state and params in swap files under the bench work dir (a main
slot row and a ``ckpt`` row)."""

SLOT_CONFIGS: list[tuple[str, dict, str]] = [
    ("moezero stage 3", {"zero_optimization.stage": 3}, "FSDP2 + DCP"),
    ("moezero stage 2 + cpu optimizer offload",
     {"zero_optimization.stage": 2, "zero_optimization.offload_optimizer.device": "cpu"},
     "moezero stage 2"),
    (NVME_CONFIG, NVME_OVERRIDES, "moezero stage 3"),
]
"""Stage 3 and offload rows: (name, overrides, the row they are compared with). Run with the
main configurations (first round only in quick mode); 'not supported yet' until the engine
implements them, then they fill in with no harness change."""

PEER_CONFIGS: list[tuple[str, str, dict]] = [
    ("FSDP2 + DCP", "fsdp2", {}),
    ("DeepSpeed ZeRO-2", "deepspeed", {"stage": 2}),
]
"""Peer rows: (name, system, system options)."""

SWEEP_SYSTEMS: list[tuple[str, str, dict]] = [
    ("moezero stage 0", "moezero", {"zero_optimization.stage": 0}),
    ("moezero stage 2", "moezero", {"zero_optimization.stage": 2}),
    ("FSDP2 + DCP", "fsdp2", {}),
]
"""Rows of the experts sweep (names as in the lists above, so the main runs give the base point)."""

TILED_ROWS: list[tuple[str, dict]] = [
    (f"stage 2 {dtype} {'tiled' if tiled else 'untiled'}",
     {"zero_optimization.stage": 2, "zero_optimization.tiled_step": tiled,
      "precision.dtype": dtype, "moe.max_group_size": 32768})
    for dtype in ("fp32", "bf16") for tiled in (True, False)
]
"""Tiled vs untiled optimizer step, moezero rows on ``size["tiled_model"]``."""

STATE_SYSTEMS: list[tuple[str, str, dict]] = [
    ("moezero stage 0", "moezero", {"zero_optimization.stage": 0}),
    ("moezero stage 1", "moezero", {"zero_optimization.stage": 1}),
    ("moezero stage 2", "moezero", {"zero_optimization.stage": 2}),
    ("FSDP2 + DCP", "fsdp2", {}),
]
"""Per-rank memory of stages 0/1/2 vs FSDP2 on ``size["tiled_model"]`` (>= 16 experts,
optimizer state dominates) at W = 2."""

WORLD_SYSTEMS = ("moezero stage 2", "FSDP2 + DCP")
"""Rows of ``STATE_SYSTEMS`` also run at every W of ``size["world_sizes"]`` (same per-rank
batch; ``ep = min(ep_size, W)``)."""

CKPT_SYSTEMS: list[tuple[str, str, dict]] = [
    ("moezero stage 2", "moezero", {"zero_optimization.stage": 2}),
    ("FSDP2 + DCP", "fsdp2", {}),
    (NVME_CONFIG, "moezero", NVME_OVERRIDES),
]
"""Checkpoint save/load on ``size["ckpt_model"]`` (one training step, then save, save, load);
the NVMe row also times a plain copy of its optimizer swap files after each save."""

ESTIMATE_ROWS: list[tuple[str, dict]] = [
    ("stage 0", {"zero_optimization.stage": 0}),
    ("stage 1", {"zero_optimization.stage": 1}),
    ("stage 2", {"zero_optimization.stage": 2}),
    ("stage 2 + cpu optimizer", {"zero_optimization.stage": 2,
                                 "zero_optimization.offload_optimizer.device": "cpu"}),
    ("stage 3", {"zero_optimization.stage": 3}),
    ("stage 3 + cpu/cpu", {"zero_optimization.stage": 3,
                           "zero_optimization.offload_optimizer.device": "cpu",
                           "zero_optimization.offload_param.device": "cpu"}),
    ("stage 3 + nvme/nvme", NVME_OVERRIDES),
]
"""The ``estimate`` series: ``moezero estimate`` against each rank's measured peak RSS, on
``size["estimate_model"]`` (state of ~1-2 GB per rank dominates the process)."""
ESTIMATE_RUNTIME_ROW = "runtime: stage 2 on a tiny model"
"""A row of the ``estimate`` series on ``size["tiny_model"]``: the process and nothing else,
the measurement behind ``moezero.estimate.RUNTIME_BYTES``."""

COLLECTIVE_STAGES = (2, 3)
GATHER_MODES: dict[str, dict] = {"bucketed": {},
                                 "per-group": {"zero_optimization.allgather_bucket_size": None}}
"""The ``collectives`` series: each stage with the default all-gather buckets and with one
all-gather per optimizer group (``allgather_bucket_size: null``), at every
``size["coll_caps"]`` (``moe.max_group_size``: fewer to more groups) on ``size["coll_model"]``
(ep 1, so every group, experts too, is sharded over both ranks)."""

TARGET_CONFIG = "moezero stage 2"
"""The moezero configuration the issue's targets name (the CLI default once it lands)."""

WORLD_SIZE = 2

def _model(dim: int, n_layers: int, ffn_dim: int, num_experts: int, *, ep_size: int,
           n_heads: int = 4) -> dict:
    """A benchmark model's shape (``benchmarks.common.model_args``): 256 tokens, top-2."""
    return {"vocab_size": 256, "dim": dim, "n_layers": n_layers, "n_heads": n_heads,
            "ffn_dim": ffn_dim, "num_experts": num_experts, "top_k": 2, "ep_size": ep_size}


_SHORT = {"micro_batch_size": 1, "seq_len": 32, "lr": 3e-3, "seed": 0, "warmup": 1, "timed": 2}
_ESTIMATE = {"estimate_model": _model(512, 4, 768, 32, ep_size=1, n_heads=8),
             "tiny_model": _model(64, 2, 64, 4, ep_size=1),
             "estimate_train": {"micro_batch_size": 4, "seq_len": 128, "lr": 3e-3, "seed": 0,
                                "warmup": 1, "timed": 2}}
_HOSTSTEP = {"numel": 1 << 25, "repeats": 5, "peer_timeout_s": 1800}
"""The ``hoststep`` series (``benchmarks.hoststep``): 32 M fp32 elements (384 MiB of master +
moments); the peer's timeout covers DeepSpeed's first build of its ``cpu_adam`` op."""
_ESTIMATE_QUICK_MODEL = _model(256, 2, 512, 16, ep_size=1)
"""The ``estimate`` series' model in quick mode (13 M params: minutes, not a quarter hour)."""
_FULL = {"model": _model(256, 4, 512, 8, ep_size=2),
         "train": {"micro_batch_size": 8, "seq_len": 128, "lr": 3e-3, "seed": 0,
                   "warmup": 5, "timed": 20},
         "repeats": 5, "slot_rounds": 5, "dd_mib": 1024, "memcpy_mib": 512,
         "sweep_experts": (8, 16, 32, 64), "world_sizes": (1, 2, 4),
         "short": {**_SHORT, "warmup": 2, "timed": 3},
         "tiled_model": _model(256, 4, 1024, 16, ep_size=2),
         "tiled_train": {**_SHORT, "timed": 5},
         "ckpt_model": _model(256, 4, 1024, 16, ep_size=2),
         "ckpt_train": {**_SHORT, "warmup": 0, "timed": 1},
         "swap_mib": 1024, "data_mb": 210,
         "coll_model": _model(64, 4, 64, 16, ep_size=1),
         "coll_train": {**_SHORT, "timed": 3}, "coll_caps": (None, 8192, 2048, 512, 256),
         **_ESTIMATE,
         "grouped": {"dim": 256, "ffn_dim": 512, "top_k": 2, "tokens": 2048,
                     "experts": (8, 64), "rounds": 5, "steps": 3},
         "hoststep": _HOSTSTEP}
SIZES = {
    "quick": {**_FULL,  # full, with smaller models and shorter loops:
              "model": _model(128, 2, 256, 8, ep_size=2),
              "train": {"micro_batch_size": 4, "seq_len": 128, "lr": 3e-3, "seed": 0,
                        "warmup": 3, "timed": 8},
              "repeats": 2, "slot_rounds": 1, "dd_mib": 256, "memcpy_mib": 256,
              "sweep_experts": (8, 16, 32), "short": _SHORT, "swap_mib": 256,
              "tiled_model": _model(128, 2, 1024, 16, ep_size=2), "tiled_train": {**_SHORT, "timed": 3},
              "ckpt_model": _model(256, 2, 1024, 16, ep_size=2), "coll_train": {**_SHORT, "timed": 2},
              "coll_caps": (None, 2048, 256), "estimate_model": _ESTIMATE_QUICK_MODEL,
              "grouped": {**_FULL["grouped"], "tokens": 1024, "rounds": 3, "steps": 2},
              "hoststep": {**_HOSTSTEP, "repeats": 3}},
    "full": _FULL,
}
"""Shared model and loop per mode. ``ep_size`` applies to moezero and DeepSpeed (expert
parallel); FSDP2 shards every parameter instead and runs all experts on each rank.
``tiled_model`` (>= 16 experts, tiny batch: optimizer state dominates memory) serves the
``tiled`` and ``state`` series; ``short`` is the loop of the memory-only ``state`` series;
``grouped`` is the one-layer model of the ``grouped`` series.
Quick mode runs 2 rounds of the compared configurations (3 before the tiled/state/ckpt series
were added) so that ``nox -s bench -- --quick`` stays under 10 minutes on 2 cores."""


def run_spec(name: str, system: str, options: dict, size: dict, *, experts: int | None = None,
             checkpoint: bool = True, series: str = "main", model: dict | None = None,
             train: dict | None = None, world: int = WORLD_SIZE) -> dict:
    """One run's full description, handed to ``benchmarks.worker`` as JSON."""
    model = dict(model or size["model"])
    if experts is not None:
        model["num_experts"] = experts
    model["ep_size"] = min(model["ep_size"], world)
    return {"name": name, "system": system, "options": dict(options), "model": model,
            "train": dict(train or size["train"]), "checkpoint": checkpoint, "series": series,
            "world_size": world}


def main_specs(size: dict) -> list[dict]:
    """The configurations compared side by side, in the order each round runs them; a spec's
    ``rounds`` (if set) limits the rounds it runs in."""
    specs = [run_spec(name, "moezero", overrides, size) for name, overrides in MOEZERO_CONFIGS]
    specs += [run_spec(name, system, opts, size) for name, system, opts in PEER_CONFIGS]
    for name, overrides, _ in SLOT_CONFIGS:
        specs.append({**run_spec(name, "moezero", overrides, size), "rounds": size["slot_rounds"]})
    return specs


def sweep_specs(size: dict) -> list[dict]:
    """Memory-vs-experts runs not already covered by the main runs (those use the base E)."""
    base = size["model"]["num_experts"]
    return [run_spec(name, system, opts, size, experts=e, checkpoint=False, series="sweep")
            for e in size["sweep_experts"] if e != base for name, system, opts in SWEEP_SYSTEMS]


def state_specs(size: dict) -> list[dict]:
    """Stages vs FSDP2 at W = 2, and the ``WORLD_SYSTEMS`` at the other world sizes."""
    return [run_spec(name, system, opts, size, checkpoint=False, series="state",
                     model=size["tiled_model"], train=size["short"], world=w)
            for w in size["world_sizes"] for name, system, opts in STATE_SYSTEMS
            if w == WORLD_SIZE or name in WORLD_SYSTEMS]


def extra_specs(size: dict) -> list[dict]:
    """Runs made once after the rounds: experts sweep, tiled step, state model, checkpoints."""
    specs = sweep_specs(size)
    specs += [run_spec(name, "moezero", opts, size, checkpoint=False, series="tiled",
                       model=size["tiled_model"], train=size["tiled_train"])
              for name, opts in TILED_ROWS]
    specs += state_specs(size)
    specs += [run_spec(name, system, opts, size, series="ckpt", model=size["ckpt_model"],
                       train=size["ckpt_train"]) for name, system, opts in CKPT_SYSTEMS]
    return specs + collectives_specs(size) + estimate_specs(size)


def estimate_specs(size: dict) -> list[dict]:
    """The ``estimate`` series: each row records its ranks' estimates beside their peaks."""
    return [{**run_spec(name, "moezero", opts, size, checkpoint=False, series="estimate",
                        model=size["estimate_model"], train=size["estimate_train"]),
             "estimate": True} for name, opts in ESTIMATE_ROWS] + [
        {**run_spec(ESTIMATE_RUNTIME_ROW, "moezero", {"zero_optimization.stage": 2}, size,
                    checkpoint=False, series="estimate", model=size["tiny_model"],
                    train=size["estimate_train"]), "estimate": True}]


def collective_name(stage: int, mode: str, cap: int | None) -> str:
    return f"stage {stage}, {mode} all-gathers, max_group_size {cap or 'none'}"


def collectives_specs(size: dict) -> list[dict]:
    """The ``collectives`` series (``GATHER_MODES`` x ``COLLECTIVE_STAGES`` x group caps), each
    run counting its collectives per step."""
    return [{**run_spec(collective_name(stage, mode, cap), "moezero",
                        {"zero_optimization.stage": stage, "moe.max_group_size": cap, **opts},
                        size, checkpoint=False, series="collectives", model=size["coll_model"],
                        train=size["coll_train"]), "count_collectives": True}
            for cap in size["coll_caps"] for stage in COLLECTIVE_STAGES
            for mode, opts in GATHER_MODES.items()]


# ---------------------------------------------------------------- the scale series

SCALE_CONFIG = "moezero stage 3 + nvme/nvme, fp32"
SCALE_OPTIONS = {"zero_optimization.stage": 3,
                 "zero_optimization.offload_optimizer.device": "nvme",
                 "zero_optimization.offload_optimizer.nvme_path": "{work}/scale-nvme",
                 "zero_optimization.offload_param.device": "nvme",
                 "zero_optimization.offload_param.nvme_path": "{work}/scale-nvme",
                 "zero_optimization.offload_param.read_ahead": 2,
                 "zero_optimization.reduce_bucket_size": 20_000_000,
                 "zero_optimization.allgather_bucket_size": 20_000_000}
"""moezero's configuration of the series (``{work}``: the bench work directory). Smaller
buckets than the default keep the reduction's send buffers (80 MB each) small beside the
3 GiB budget. ``read_ahead`` is the default (two gather units of 200 MB), written out so the
report shows it: on the 20-layer model it gave 2.44 GiB per rank and 1.33x the disk time, one
unit 2.25 GiB and 1.60x (steps of 95-129 s). On the earlier 10-layer model (400 MB units) two
gave 3.36 GiB (1.52x), one 3.00 GiB (1.45x), none 2.63 GiB (1.94x, on a busier machine)."""

_TRAIN = {"micro_batch_size": 1, "seq_len": 256, "lr": 3e-4, "seed": 0, "warmup": 0, "timed": 3}
SCALE_SIZES = {
    "quick": {"model": _model(1024, 1, 2048, 32, ep_size=2, n_heads=8),
              "train": _TRAIN, "dd_mib": 512},
    "mid": {"model": _model(1024, 4, 1000, 32, ep_size=2, n_heads=8),
            "train": _TRAIN, "dd_mib": 1024},
    "full": {"model": _model(1024, 20, 1000, 32, ep_size=2, n_heads=8),
             "train": _TRAIN, "dd_mib": 1024},
}
"""The series' model per mode: ``full`` is 2.05 B parameters in 20 layers (32 experts of
width 1000 per MoE layer, 16 per rank at ep 2, so a gather unit is 200 MB; fp32 master +
moments + param shard = 32.8 GB of training state), ``mid`` 4 of those layers (0.41 B: the
``nvme`` series, which cannot run the full size on a shared machine), ``quick`` one layer of
32 experts of width 2048 (0.21 B). An earlier full model (10 layers of width 2000, 2.01 B) had 400 MB units: with
one unit read ahead its peak RSS was 3.00 GiB per rank, 2.2 MiB over the 3 GiB target; with
two, 3.36 GiB. Halving the unit is what lets two units be read ahead within the budget."""

_BEFORE = {"zero_optimization.offload_optimizer.step_in_forward": False}
_KEEP = {"zero_optimization.offload_param.keep_for_backward": 800_000_000,
         "zero_optimization.offload_optimizer.keep_grads": 800_000_000}
_READ = {"zero_optimization.offload_optimizer.read_in_backward": 800_000_000}
NVME_VARIANTS = {
    "today": _BEFORE,
    "keep 800 MB": {**_BEFORE, **_KEEP},
    "keep + read 800 MB": {**_BEFORE, **_KEEP, **_READ},
    "step in forward": {},
    "step in forward + keep + read 800 MB": {**_KEEP, **_READ}}
"""The ``nvme`` series' configurations (``benchmarks.nvme_phases``), each run with the
``scale`` series' options plus these: ``today`` is the series as measured in issue 28; the
others keep the forward's last gather units for backward and the first reduced gradient
partitions in memory, each up to that many bytes per rank (the same numbers, fewer bytes), and
the third also reads that many bytes of the step's optimizer state during backward. These
three step before the forward (``step_in_forward: false``); ``step in forward`` is the
default since issue 28 (each step's swapped updates behind the next forward), alone and with
the third's budgets. (An earlier run also had ``keep 400 MB``: 35.1 B per parameter at ``mid``.)"""

SCALE_TARGETS = {"rss_bytes": 3 * 2**30, "disk_ratio": 1.5, "params": 2.0e9, "experts": 32}


def scale_spec(mode: str) -> dict:
    """The run spec of the ``scale`` series (``benchmarks.worker`` JSON; ``benchmarks.scale``
    runs it, ``benchmarks.scale_rank`` is its rank)."""
    size = SCALE_SIZES[mode]
    return {"name": SCALE_CONFIG, "system": "moezero", "options": dict(SCALE_OPTIONS),
            "model": dict(size["model"]), "train": dict(size["train"]), "checkpoint": True,
            "series": "scale", "world_size": 2}


def overrides(spec: dict) -> list[str]:
    """The run spec as ``KEY=VALUE`` config overrides (values as JSON, read back as YAML)."""
    m, t = spec["model"], spec["train"]
    values = {
        "model.vocab_size": m["vocab_size"], "model.dim": m["dim"], "model.n_layers": m["n_layers"],
        "model.n_heads": m["n_heads"], "model.ffn_dim": m["ffn_dim"],
        "moe.num_experts": m["num_experts"], "moe.top_k": m["top_k"], "moe.ep_size": m["ep_size"],
        "train.micro_batch_size": t["micro_batch_size"], "train.seq_len": t["seq_len"],
        "train.seed": t["seed"], "train.steps": t["warmup"] + t["timed"],
        # Constant lr and fp32 everywhere, as the peers run.
        "optimizer.lr": t["lr"], "optimizer.warmup_steps": 0, "optimizer.min_lr_ratio": 1.0,
        "precision.dtype": "fp32",
        **spec["options"],
    }
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]
