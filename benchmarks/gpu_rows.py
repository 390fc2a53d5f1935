"""The GPU benchmark's rows and how one row runs (``benchmarks.gpu``, ``benchmarks.gpu_check``):
the model and training sizes (full and smoke), the systems and options of each row, and
``run_row``, which trains one row in a fresh ``benchmarks.gpu_worker`` process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.launch import error_line

REPO = Path(__file__).resolve().parent.parent
MODEL = {"vocab_size": 32000, "dim": 1024, "n_layers": 12, "n_heads": 16, "ffn_dim": 1536,
         "num_experts": 16, "top_k": 2}
TRAIN = {"micro_batch_size": 8, "seq_len": 2048, "lr": 3e-4, "seed": 0, "warmup": 3, "timed": 10}
SMOKE_MODEL = {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 48,
               "num_experts": 4, "top_k": 2}
SMOKE_TRAIN = {"micro_batch_size": 2, "seq_len": 16, "lr": 3e-4, "seed": 0, "warmup": 1, "timed": 2}
_NVME = {"zero_optimization.offload_optimizer.device": "nvme",
         "zero_optimization.offload_optimizer.nvme_path": "{work}/nvme",
         "zero_optimization.offload_param.device": "nvme",
         "zero_optimization.offload_param.nvme_path": "{work}/nvme"}
ROWS: list[tuple[str, str, dict, bool]] = [  # (name, system, config overrides, grouped experts)
    ("moezero stage 2", "moezero", {"zero_optimization.stage": 2}, True),
    ("moezero stage 2, per-expert loop", "moezero", {"zero_optimization.stage": 2}, False),
    ("moezero stage 2, train.deterministic", "moezero",
     {"zero_optimization.stage": 2, "train.deterministic": True}, True),
    ("moezero stage 3 + cpu offload", "moezero",
     {"zero_optimization.stage": 3, "zero_optimization.offload_optimizer.device": "cpu",
      "zero_optimization.offload_param.device": "cpu"}, True),
    ("moezero stage 3 + nvme offload", "moezero", {"zero_optimization.stage": 3, **_NVME}, True),
    ("FSDP2 (fully_shard, bf16 params, fp32 reduce)", "fsdp2", {}, True),
]


def run_row(name: str, system: str, options: dict, grouped: bool, args, work: Path, *,
            model: dict | None = None, train: dict | None = None) -> dict:
    """One row in a fresh ``benchmarks.gpu_worker`` process (``model``/``train``: sizes other
    than the benchmark's, e.g. ``benchmarks.gpu_check``'s)."""
    spec = {"name": name, "system": system, "grouped": grouped,
            "options": {k: v.replace("{work}", str(work)) if isinstance(v, str) else v
                        for k, v in options.items()},
            "model": model or (SMOKE_MODEL if args.smoke else MODEL),
            "train": train or (SMOKE_TRAIN if args.smoke else TRAIN),
            "device": "cpu" if args.smoke else "cuda", "dtype": "fp32" if args.smoke else "bf16"}
    (work / "nvme").mkdir(parents=True, exist_ok=True)
    tag = "".join(c if c.isalnum() else "-" for c in name.lower())
    spec_path, result_path, log_path = (work / f"{tag}.{ext}" for ext in ("json", "result.json", "log"))
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_worker", str(spec_path),
                                 str(result_path)], stdout=log, stderr=subprocess.STDOUT,
                                cwd=REPO, timeout=args.timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {args.timeout:.0f} s"
    if rc == 0 and result_path.exists():
        return {"name": name, **json.loads(result_path.read_text())}
    return {"name": name, "status": "failed",
            "error": rc if isinstance(rc, str) else error_line(log_path.read_text())}
