"""The ``bigbase`` series (issue 40, outside CI): LoRA on a big MoE whose frozen base is read
where it lies, at W = 2, ep 2, ZeRO stage 3, params on NVMe.

``python -m benchmarks.bigbase [--quick | --size S] [--work DIR] [--out BENCHMARKS.md]
[--reuse] [--rows R,...] [--peer-python PY] [--from-json FILE]``. It writes a random
Qwen3-MoE-shaped base as a bf16 Hugging Face folder (``benchmarks.bigbase_model``: tensor by
tensor, never in memory), ``moezero import-hf`` keeps it bf16, deleting each HF shard once read
(``benchmarks.bigbase_import``: the folder and its import never lie whole on the disk together
for long), ``prepare-data --format chat`` makes the data, then in fresh ``torchrun`` processes
(``benchmarks.bigbase_rank``), each watched (``benchmarks.bigbase_watch``: free disk, swap and
checkpoint bytes, RSS): LoRA r 16 on attention and experts, ``steps`` steps and a save, then
the resume from that checkpoint in fresh processes (one step); beside it the compute time of the same step with the weights in memory, measured on
``compute_layers`` layers (random init, no base) and scaled by depth. ``dd`` measures the disk
before and after; a step's disk time is its bytes read over the ``dd`` read rate. Then the
peer row (``benchmarks.bigbase_peer``: TRL ``SFTTrainer`` + PEFT + DeepSpeed ZeRO-3,
``offload_param`` on NVMe, the optimizer on the host) on the HF folder written again once the
import is removed, bounded in time (``--peer-timeout``) and free disk. The results are saved
to ``WORK/results-bigbase.json`` before the peer runs and after; ``--from-json`` renders them
(``benchmarks.bigbase_report``). ``--reuse`` keeps the base and data an earlier run left.

``full`` is the issue's 16 B model (Qwen3-30B-A3B's widths, 128 experts top-8, 24 layers):
31 GB of bf16, computed in bf16 (this box's CPU has AMX-bf16: its bf16 matmuls measured 2.3x
its fp32 ones), the adapters' optimizer state on NVMe; it needs about 40 GB of disk at once
(60 GB for a few minutes while the import's files are allocated) and hours here. ``mid``
has ``full``'s widths and 2 layers; ``--quick`` is a tiny one (fp32) that runs in minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.finetune import _cli
from benchmarks.fmt import write_section
from benchmarks.machine import dd_bandwidth, machine_info
from moezero.examples import tiny_hf

SIZES = {
    "full": {"model": {"dim": 2048, "ffn_dim": 768, "n_layers": 24, "n_heads": 32,
                       "n_kv_heads": 4, "head_dim": 128, "num_experts": 128, "top_k": 8},
             "vocab": 151936, "seq_len": 1024, "steps": 3, "compute_layers": 2, "dd_mib": 1024,
             "dtype": "bf16", "optimizer": "nvme"},
    "quick": {"model": {"dim": 64, "ffn_dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                        "head_dim": 16, "num_experts": 8, "top_k": 2},
              "vocab": 512, "seq_len": 128, "steps": 3, "compute_layers": 1, "dd_mib": 64,
              "dtype": "fp32"},
}
SIZES["mid"] = {**SIZES["full"], "model": {**SIZES["full"]["model"], "n_layers": 2},
                "compute_layers": 1, "dd_mib": 256}  # ``full``'s widths, 2 layers: a check
PEER_PYTHON = "/work/ci/main/.nox/bench-peers/bin/python"
MEMORY = ["moe.split_dense_by_layer=true", "activation_checkpointing.enabled=true",
          "model.loss_chunk_tokens=128", "zero_optimization.prefetch_max_bytes=67108864",
          "zero_optimization.offload_param.read_ahead=1",
          "zero_optimization.offload_optimizer.step_in_forward=false"]
"""What keeps a rank of ``full`` within 3 GiB (docs/finetune.md, "A big base on a small
host"): a dense group per block (a unit gathers its own block; the embedding and the head
apart, each around its own call), blocks recomputed in backward, the head's cross-entropy 128
tokens at a time (the 1,024 x 151,936 logits never whole), no MoE layer gathered ahead of its
use (two layers' experts never at once), the shards of one unit read ahead, the step's
swapped updates done before the next forward (not behind it: their buffers beside it)."""
ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}
"""The ranks' environment: oneDNN's cache of compiled matmuls kept ~0.5 GB a rank on the
``mid`` size (bf16 matmuls of every token count an expert got, their reordered weights);
without it they are made again per call (measured: step 2's peak RSS 2.43 against 2.81 GB
a rank, its time 51 against 44 s). The compute row runs with it too, so the step-time target
compares like with like."""
LORA = ["peft.method=lora", "peft.r=16", "peft.alpha=32.0", "peft.targets=[attn, experts]"]


def write_hf(hf: Path, size: dict) -> dict:
    """The random bf16 HF folder (the same bytes on every call: seeded), with the tokenizer."""
    from benchmarks.bigbase_model import write_model

    vocab = max(tiny_hf.save_tokenizer(hf, 512), size["vocab"])
    return {"params": write_model(hf, size["model"], vocab), "vocab": vocab,
            "hf_bytes": _bytes(hf)}


def prepare(work: Path, size: dict) -> dict:
    """The bf16 HF folder, its bf16 import (each HF shard deleted once imported:
    ``benchmarks.bigbase_import``; the folder is written again for the peer), the chat data;
    paths and sizes."""
    from benchmarks.bigbase_import import import_consuming

    root = work / "bigbase"
    shutil.rmtree(root, ignore_errors=True)
    hf, chats = root / "hf", root / "chats.jsonl"
    start = time.perf_counter()
    inputs = write_hf(hf, size)
    written = time.perf_counter()
    tiny_hf.write_jsonl(tiny_hf.conversations(200, 0, size["seq_len"] // 4), chats)
    import_consuming(hf, root / "base")
    shutil.rmtree(hf)
    _cli("prepare-data", str(chats), "--tokenizer", str(root / "base"), "--format", "chat",
         "--out", str(root / "data"))
    print(f"prepared: HF folder {written - start:.0f} s, import "
          f"{time.perf_counter() - written:.0f} s", flush=True)
    inputs = {**inputs, "root": str(root), "base_bytes": _bytes(root / "base"),
              "write_s": written - start, "import_s": time.perf_counter() - written}
    (root / "inputs.json").write_text(json.dumps(inputs))
    return inputs


def prepared(work: Path, size: dict) -> dict:
    """``--reuse``: the inputs an earlier ``prepare`` of this size left in ``work``, else
    ``prepare``'s."""
    found = work / "bigbase" / "inputs.json"
    if found.exists() and (work / "bigbase" / "base" / "latest").exists():
        print(f"reusing the base and data of {found.parent}", flush=True)
        return json.loads(found.read_text())
    return prepare(work, size)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def overrides(inputs: dict, size: dict, *, in_memory: bool) -> list[str]:
    """The ``--set`` items of a row: the base and data (or, for the compute row, no base and
    ``compute_layers`` layers), LoRA, stage 3, params on NVMe or in memory, fp32 compute."""
    root, swap = inputs["root"], Path(inputs["root"]) / "swap"
    swap.mkdir(exist_ok=True)
    param = ["zero_optimization.offload_param.device=none"] if in_memory else [
        "zero_optimization.offload_param.device=nvme",
        f"zero_optimization.offload_param.nvme_path={swap}"]
    base = [f"model.n_layers={size['compute_layers']}", "checkpoint.load=null",
            f"model.vocab_size={inputs['vocab']}", "model.qk_norm=head",
            *(f"model.{k}={v}" for k, v in size["model"].items() if k not in (
                "n_layers", "num_experts", "top_k"))] if in_memory else \
        [f"checkpoint.load={root}/base"]
    return [*base, f"data.path={root}/data", "data.val_fraction=0", "train.eval_every=0",
            f"train.seq_len={size['seq_len']}", "train.micro_batch_size=1",
            f"train.steps={size['steps'] + 1}", "moe.ep_size=2", *MEMORY,
            f"moe.num_experts={size['model']['num_experts']}",
            f"moe.top_k={size['model']['top_k']}", f"precision.dtype={size['dtype']}",
            "zero_optimization.stage=3", *_optimizer(size.get("optimizer", "cpu"), swap),
            *param, *LORA]


def _row(python: str, module: str, spec: dict, tag: str, work: Path, limits: dict,
         folders: list[Path]) -> dict:
    from benchmarks.bigbase_watch import run_watched

    base = work / "bigbase-runs"
    base.mkdir(parents=True, exist_ok=True)
    paths = {k: base / f"{tag}.{k}" for k in ("spec", "result", "log")}
    spec = {**spec, "ckpt_dir": str(base / f"{tag}-ckpt")}
    run = run_watched(python, module, spec, paths, limits, [*folders, Path(spec["ckpt_dir"])])
    print(f"{tag}: {run.get('status')} {run.get('error', '')} ({run['wall_s']:.0f} s)",
          flush=True)
    return run


def _optimizer(device: str, swap: Path) -> list[str]:
    """The optimizer's tier: ``full``'s LoRA r 16 on 3,072 experts trains 415 M params, whose
    fp32 master and moments (5 GB) the host cannot hold within 3 GiB a rank: on NVMe."""
    out = [f"zero_optimization.offload_optimizer.device={device}"]
    return [*out, f"zero_optimization.offload_optimizer.nvme_path={swap}"] \
        if device == "nvme" else out


def measure(args, work: Path, size: dict, results: dict) -> dict:
    """dd, the inputs, the in-place row, the compute row, dd; the results so far are saved
    (``save``) before the peer row runs on the HF folder written again."""
    disk = [dd_bandwidth(str(work), size["dd_mib"])]
    inputs = prepared(work, size) if args.reuse else prepare(work, size)
    res = results["bigbase"] = {"inputs": inputs, "size": size, "disk": disk, "runs": {},
                                "uptime": [_uptime()]}
    limits = {"timeout_s": args.timeout, "min_free": 1 << 30}
    for name, in_memory in (("in place", False), ("compute", True)):
        if name not in args.rows:
            continue
        spec = {"steps": size["steps"], "save": not in_memory, "env": ENV,
                "overrides": overrides(inputs, size, in_memory=in_memory)}
        res["runs"][name] = _row(sys.executable, "benchmarks.bigbase_rank", spec,
                                 f"bigbase-{name.replace(' ', '-')}", work, limits,
                                 [Path(inputs["root"]) / "swap"])
        if spec["save"] and res["runs"][name].get("status") == "ok":
            res["runs"]["resume"] = resume_row(spec, res["runs"][name], work, limits, inputs)
    disk.append(dd_bandwidth(str(work), size["dd_mib"]))
    res["uptime"].append(_uptime())
    save(work, results)
    if args.peer_python and "peer" in args.rows:
        res["runs"]["peer"] = peer_row(args, work, size, inputs)
        res["uptime"].append(_uptime())
    return res


def resume_row(spec: dict, saved: dict, work: Path, limits: dict, inputs: dict) -> dict:
    """The resume from the in-place row's checkpoint in fresh processes (as a real resume):
    the adapters loaded, the base read in place again, one step."""
    step = saved["ranks"][0]["checkpoint"]
    spec = {**spec, "steps": 1, "save": False,
            "overrides": [*spec["overrides"], f"checkpoint.load={step}"]}
    return _row(sys.executable, "benchmarks.bigbase_rank", spec, "bigbase-resume", work, limits,
                [Path(inputs["root"]) / "swap"])


def peer_row(args, work: Path, size: dict, inputs: dict) -> dict:
    """The peer on the HF folder written again (the import removed first: the box's disk holds
    one copy and the peer's swap), bounded by ``--peer-timeout`` and a free-disk floor."""
    root = Path(inputs["root"])
    shutil.rmtree(root / "base", ignore_errors=True)
    shutil.rmtree(root / "swap", ignore_errors=True)
    hf, swap = root / "hf", root / "peer-swap"
    write_hf(hf, size)
    swap.mkdir(exist_ok=True)
    spec = peer_spec(hf, root, size, inputs, swap)
    try:
        return _row(args.peer_python, "benchmarks.bigbase_peer", spec, "bigbase-peer", work,
                    {"timeout_s": args.peer_timeout, "min_free": 2 << 30}, [swap])
    finally:
        shutil.rmtree(swap, ignore_errors=True)


def peer_spec(hf: Path, root: Path, size: dict, inputs: dict, swap: Path) -> dict:
    """The peer's spec; its swap buffers hold the largest param's partition on 2 ranks: the
    embedding, or transformers' fused gate-and-up tensor of a layer's experts (E x 2F x D)."""
    m = size["model"]
    largest = max(inputs["vocab"] * m["dim"], m["num_experts"] * 2 * m["ffn_dim"] * m["dim"])
    return {"model_dir": str(hf), "chats": str(root / "chats.jsonl"), "steps": size["steps"],
            "seq_len": size["seq_len"], "nvme_path": str(swap), "largest_partition": -(-largest // 2)}


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def save(work: Path, results: dict) -> None:
    (work / "results-bigbase.json").write_text(json.dumps(results, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bigbase",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny base (minutes)")
    p.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="the base's size (default: full; --quick: quick)")
    p.add_argument("--work", default="/tmp/moezero-bigbase", help="work directory")
    p.add_argument("--out", default=None, help="also splice the section into this report")
    p.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds per row")
    p.add_argument("--peer-python", default=PEER_PYTHON,
                   help="the peer venv's python ('' : no peer row)")
    p.add_argument("--peer-timeout", type=float, default=25 * 60.0, help="seconds for the peer")
    p.add_argument("--from-json", default=None, help="render this results file, measure nothing")
    p.add_argument("--rows", type=lambda v: v.split(","), default=["in place", "compute", "peer"],
                   help="the rows to run, comma-separated (default: in place,compute,peer)")
    p.add_argument("--reuse", action="store_true",
                   help="keep the base and data an earlier run of this size left in --work")
    args = p.parse_args(argv)
    start, work = time.perf_counter(), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        results = {"machine": machine_info(), "command": "python -m benchmarks.bigbase "
                   + " ".join(argv if argv is not None else sys.argv[1:])}
        measure(args, work, SIZES[args.size or ("quick" if args.quick else "full")], results)
        save(work, results)
    from benchmarks.bigbase_report import table  # here: a long run renders the newest table

    section = table(results)
    if args.out:
        return write_section(Path(args.out), section, "bigbase", start)
    print("\n".join(section))
    return 0


if __name__ == "__main__":
    sys.exit(main())
