"""``moezero import-deepspeed`` of a >= 1 GB DeepSpeed ZeRO-2 native-MoE checkpoint (issue 27):
bytes in and out, import time against ``dd`` copying the same files, peak RSS. Not a test.

Two steps, two venvs::

    # DeepSpeed's venv: a Qwen3-MoE decoder with DeepSpeed MoE blocks, one step, saved
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/deepspeed_import.py make DIR
    # moezero's venv: import it (in a child process: its peak RSS) and dd the same files
    python benchmarks/deepspeed_import.py measure DIR

``make`` reuses the fixture script's model pieces (tests/fixtures/deepspeed/make_fixtures.py)
and never imports moezero; ``measure`` prints one Markdown row for BENCHMARKS.md. Delete DIR
afterwards (about 1.2 GB in, 0.8 GB out).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

BIG = dict(hidden_size=512, moe_intermediate_size=1280, num_experts=8, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=8, head_dim=64, vocab_size=2048)


def make(out: Path) -> None:
    """One ZeRO-2 step of the big native-MoE model at W = ep = world size; saved to out/ckpt."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" /
                           "deepspeed"))
    import deepspeed
    import make_fixtures as fx
    import torch.distributed as dist

    fx.NATIVE.update(BIG)
    fx.MODEL["vocab_size"] = BIG["vocab_size"]
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    case = f"native_moe_z2_w{world}_ep{world}"
    model, groups = fx.build_model(case, world)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups,
                                      config=fx.ds_config(2, "none", out / "swap"))
    if rank == 0:
        model.config.save_pretrained(out / "ckpt")
    fx.train_step(engine, 0, world, rank)
    engine.save_checkpoint(str(out / "ckpt"), tag="global_step1")


def measure(root: Path) -> None:
    """Import (child process: wall time, peak RSS), then dd of the same files, one row."""
    out = root / "imported"
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "moezero.cli", "import-deepspeed", str(root / "ckpt"),
                    "--out", str(out)], check=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    tag = root / "ckpt" / "global_step1"
    bytes_in = sum(p.stat().st_size for p in tag.iterdir())
    bytes_out = sum(p.stat().st_size for p in next(out.glob("step_*")).iterdir())
    dd_s = _dd(tag, root / "dd")
    print("| source | bytes in | bytes out | in/out | import s | dd copy of the input s | "
          "import/dd | importer peak RSS |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| ZeRO-2 native MoE ({tag}) | {bytes_in:,} | {bytes_out:,} | "
          f"{bytes_in / bytes_out:.2f}x | {seconds:.1f} | {dd_s:.1f} | {seconds / dd_s:.2f} | "
          f"{peak / 2**20:.0f} MiB |")
    shutil.rmtree(out)


def _dd(src: Path, dst: Path) -> float:
    """Seconds for dd to copy every file of ``src`` (8 MiB blocks, fsync at the end)."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    start = time.perf_counter()
    for p in sorted(src.iterdir()):
        subprocess.run(["dd", f"if={p}", f"of={dst / p.name}", "bs=8M", "conv=fsync",
                        "status=none"], check=True)
    seconds = time.perf_counter() - start
    shutil.rmtree(dst)
    return seconds


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    {"make": make, "measure": measure}[sys.argv[1]](Path(sys.argv[2]))
