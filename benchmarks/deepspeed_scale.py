"""DeepSpeed's nearest configuration to moezero's ``scale`` benchmark (issue 16): W ranks on
gloo, ZeRO-3 with parameters and optimizer state on NVMe, fp32, a model of ``--params-b``
billion parameters built under ``deepspeed.zero.Init``; it initialises and trains a few steps.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/deepspeed_scale.py \\
        --params-b 2.0 --nvme DIR --steps 3 --seq 128 --batch 1 --out FILE.json

Runs in the peer venv (DeepSpeed 0.19.8 with its async_io op, transformers for the model
classes, the repository on ``PYTHONPATH``). ``--kind autoep`` (the default) is a Mixtral-shaped
MoE (``--dim``, ``--ffn`` per expert, ``--experts``, ``--top-k``) whose MoE blocks DeepSpeed's
AutoEP replaces with expert-parallel ones (``--ep``); ``--kind dense`` is the Llama-shaped dense
model of the same dims with an MLP ``experts x ffn`` wide, so both count the same parameters
(less the router). The number of layers is the smallest that reaches ``--params-b``.

Writes one JSON object (see :func:`result`). A failure is a result too: ``ok`` false, the error
line and what was measured until then. A watchdog in every rank ends the run when the ranks'
resident memory together would pass ``--max-rss-gib`` (each rank gets its share) or the run
passes ``--timeout-min``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import AnonPeak, tree_bytes

GIB = 2**30


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-b", type=float, required=True, help="billions of parameters, at least")
    p.add_argument("--nvme", required=True, help="swap folder of params and optimizer state")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank and step")
    p.add_argument("--out", required=True, help="the JSON result")
    p.add_argument("--kind", choices=("autoep", "dense"), default="autoep")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2048, help="hidden width of one expert")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ep", type=int, default=2, help="AutoEP's expert-parallel size")
    p.add_argument("--sub-group-size", type=int, default=100_000_000,
                   help="ZeRO-3 optimizer sub-group (elements swapped in at once)")
    p.add_argument("--param-buffers", type=int, default=5,
                   help="offload_param.buffer_count (each holds the largest partition)")
    p.add_argument("--max-rss-gib", type=float, default=16.0, help="all ranks together")
    p.add_argument("--timeout-min", type=float, default=40.0)
    return p


def hf_config(args: argparse.Namespace, n_layers: int):
    """The transformers config of the model: Mixtral (autoep) or Llama (dense), no GQA."""
    from transformers import LlamaConfig, MixtralConfig

    common = dict(vocab_size=args.vocab, hidden_size=args.dim, num_hidden_layers=n_layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.heads,
                  max_position_embeddings=args.seq, tie_word_embeddings=False)
    if args.kind == "autoep":
        return MixtralConfig(intermediate_size=args.ffn, num_local_experts=args.experts,
                             num_experts_per_tok=args.top_k, **common)
    return LlamaConfig(intermediate_size=args.ffn * args.experts, **common)


def model_class(kind: str):
    from transformers import LlamaForCausalLM, MixtralForCausalLM

    return MixtralForCausalLM if kind == "autoep" else LlamaForCausalLM


def meta_sizes(args: argparse.Namespace, n_layers: int) -> tuple[int, int]:
    """(parameters, elements of the largest parameter) of the model, built without storage."""
    import torch

    with torch.device("meta"):
        model = model_class(args.kind)(hf_config(args, n_layers))
    sizes = [p.numel() for p in model.parameters()]
    return sum(sizes), max(sizes)


def shape(args: argparse.Namespace) -> dict:
    """The number of layers reaching ``--params-b``, the exact count and the largest param."""
    one, two = meta_sizes(args, 1)[0], meta_sizes(args, 2)[0]
    per_layer, rest = two - one, 2 * one - two
    n_layers = max(1, math.ceil((args.params_b * 1e9 - rest) / per_layer))
    params, largest = meta_sizes(args, n_layers)
    return {"n_layers": n_layers, "params": params, "largest_param": largest,
            "dim": args.dim, "heads": args.heads, "vocab": args.vocab,
            "ffn": args.ffn * (args.experts if args.kind == "dense" else 1),
            "experts": args.experts if args.kind == "autoep" else 0, "top_k": args.top_k}


def ds_config(args: argparse.Namespace, largest_param: int, world: int) -> dict:
    """ZeRO-3, params and optimizer on NVMe, fp32, torch's AdamW (no op build). The param swap
    buffers hold the largest partition; ``stage3_prefetch_bucket_size: 0`` because prefetch
    asserts with NVMe params on this version (shared PEERS notes, DeepSpeed 0.19.8); reuse
    distance and live parameters 0, or gathered params keep their swap buffers (the defaults,
    1e9 elements, held every buffer after one step: "Not enough buffers 0 for swapping 3")."""
    nvme = str(Path(args.nvme).resolve())
    buffer = math.ceil(largest_param / world / 2**20) * 2**20
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {
               "lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
               "torch_adam": True}},
           "zero_optimization": {
               "stage": 3, "stage3_prefetch_bucket_size": 0,
               "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0,
               "sub_group_size": args.sub_group_size,
               "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": False,
                                 "buffer_count": args.param_buffers, "buffer_size": buffer, "max_in_cpu": 0},
               "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": False}},
           "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
                   "single_submit": False, "overlap_events": True}}
    if args.kind == "autoep":
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": args.ep,
                                  "preset_model": "mixtral"}
    return cfg


def write_once(out: str, data: dict) -> bool:
    """Write ``out`` unless it exists (the first failing rank's record wins); atomic."""
    folder = os.path.dirname(os.path.abspath(out))
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as tmp:
        json.dump(data, tmp, indent=1)
    try:
        os.link(tmp.name, out)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp.name)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def status_bytes(key: str) -> int:
    """A size of this process from ``/proc/self/status``: ``VmRSS`` (resident now), ``VmHWM``
    (its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    return 0


class Run:
    """One rank's measurements, its failure report and its watchdog."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int):
        self.args, self.rank, self.world = args, rank, world
        self.start = time.perf_counter()
        self.anon = AnonPeak()
        self.info: dict = {"kind": args.kind, "params": None, "config": None, "model": None,
                           "init_s": None, "step_s": [], "losses": [], "swap_bytes": None}
        self._done = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def record(self) -> dict:
        return {"rank": self.rank, "peak_rss": status_bytes("VmHWM"), "peak_anon": self.anon.peak}

    def fail(self, error: str) -> None:
        """Report the failure as the result (unless a rank already did) and end this process."""
        self._done.set()
        per_rank = [None] * self.world
        rss, anon = list(per_rank), list(per_rank)
        rss[self.rank], anon[self.rank] = status_bytes("VmHWM"), self.anon.stop()
        write_once(self.args.out, result(self.info, False, f"rank {self.rank}: {error}", rss, anon))
        print(f"deepspeed_scale: rank {self.rank}: {error}", file=sys.stderr, flush=True)
        os._exit(1)

    def _watch(self) -> None:
        budget = self.args.max_rss_gib * GIB / self.world
        deadline = self.start + self.args.timeout_min * 60
        while not self._done.wait(0.05):
            if status_bytes("VmRSS") > budget:
                self.fail(f"exceeded {budget / GIB:.1f} GiB RSS (its share of "
                          f"{self.args.max_rss_gib:g} GiB for {self.world} ranks)")
            if time.perf_counter() > deadline:
                self.fail(f"timed out after {self.args.timeout_min:g} min")

    def finish(self) -> None:
        self._done.set()
        self.anon.stop()


def result(info: dict, ok: bool, error: str | None, rss: list, anon: list) -> dict:
    """The JSON object: ``ok``, ``error`` (one line), ``kind``, ``params``, ``peak_rss_bytes``
    and ``peak_anon_bytes`` per rank (VmHWM; anonymous resident memory sampled every 10 ms),
    ``init_s``, ``step_s`` per step, ``swap_bytes`` (the NVMe folder after init), ``config``
    (DeepSpeed's), plus ``model`` (its shape, and how many MoE blocks AutoEP replaced),
    ``losses``, ``swap_bytes_after_steps`` (optimizer swap files grow on the first step) and
    the versions."""
    return {"ok": ok, "error": error, "kind": info["kind"], "params": info["params"],
            "peak_rss_bytes": rss, "peak_anon_bytes": anon, "init_s": info["init_s"],
            "step_s": info["step_s"], "swap_bytes": info["swap_bytes"],
            "config": info["config"], "model": info["model"], "losses": info["losses"],
            "swap_bytes_after_steps": info.get("swap_bytes_after_steps"),
            "versions": info.get("versions")}


def build(run: Run):
    """The model under ``zero.Init`` (transformers' own ZeRO-3 path) and the engine."""
    import deepspeed
    import torch
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    args, info = run.args, run.info
    model_shape = shape(args)
    info.update(model=model_shape, params=model_shape["params"],
                config=ds_config(args, model_shape["largest_param"], run.world),
                versions={"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                          "transformers": transformers.__version__})
    keep = HfDeepSpeedConfig(info["config"])  # makes from_config build under zero.Init
    model = model_class(args.kind)._from_config(hf_config(args, model_shape["n_layers"]))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=info["config"])
    del keep
    return engine


def train(run: Run, engine) -> None:
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1234 + run.rank)
    for _ in range(run.args.steps):
        batch = torch.randint(0, run.args.vocab, (run.args.batch, run.args.seq + 1), generator=gen)
        start = time.perf_counter()
        out = engine(input_ids=batch[:, :-1], labels=batch[:, 1:])
        engine.backward(out.loss)
        engine.step()
        dist.barrier()
        run.info["step_s"].append(time.perf_counter() - start)
        run.info["losses"].append(out.loss.item())


def measure(run: Run) -> None:
    """Init (timed to the engine being ready on every rank), the swap folder's size, steps;
    rank 0 gathers every rank's peaks and writes the result."""
    import torch.distributed as dist

    engine = build(run)
    dist.barrier()
    run.info["init_s"] = time.perf_counter() - run.start
    run.info["swap_bytes"] = tree_bytes(run.args.nvme)[0]
    run.info["model"]["autoep_layers"] = sum(type(m).__name__ == "AutoEPMoELayer"
                                             for m in engine.module.modules())
    train(run, engine)
    run.info["swap_bytes_after_steps"] = tree_bytes(run.args.nvme)[0]
    run.finish()
    records = [None] * run.world
    dist.all_gather_object(records, run.record())
    if run.rank == 0:
        write_once(run.args.out, result(run.info, True, None, [r["peak_rss"] for r in records],
                                        [r["peak_anon"] for r in records]))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if rank == 0:
        Path(args.out).unlink(missing_ok=True)
    Path(args.nvme).mkdir(parents=True, exist_ok=True)
    run = Run(args, rank, world)
    try:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        measure(run)
    except Exception as exc:  # a failure is a result: "the error it stops with"
        traceback.print_exc()  # the log keeps where it stopped; the result keeps one line
        run.fail(one_line(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
