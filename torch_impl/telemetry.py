"""Training telemetry: MoE expert load, peak memory per step, model FLOPs utilisation, and
TensorBoard event files.

- ``ExpertLoad`` reads every MoE layer's ``last_stats`` after each forward (a forward hook;
  ``MoE.last_stats`` holds ``tokens_per_expert``, int64 [E]: the assignments this rank's
  tokens made to each global expert and that were kept, and ``dropped``: the assignments
  capacity dropped), sums them over a step's micro-batches and, once per step, over all
  ranks (one small all-reduce). Per layer it reports tokens per expert, the dropped fraction
  (dropped / all assignments) and the load imbalance (max / mean tokens per expert; 1 is
  perfect balance, E means one expert took everything).
- ``PeakMemory`` is the peak of one step, not since start: CUDA's peak-allocated counter is
  reset before each step; on Linux CPUs the process's peak RSS is reset through
  ``/proc/self/clear_refs`` (elsewhere the peak since start is all there is).
- ``flops_per_token`` and ``peak_flops`` give MFU = achieved model FLOPs / the device's dense
  peak, for devices in ``PEAK_TFLOPS`` (None elsewhere, e.g. CPUs).
- ``LoadWatch`` turns the loads into warnings, once per layer: an expert without tokens, or
  an imbalance above ``telemetry.max_imbalance``, for ``telemetry.dead_expert_steps`` steps.
- ``TensorBoard`` writes rank 0's scalars (and the expert-load image) under
  ``<run dir>/tensorboard`` when the ``tensorboard`` package is installed (the ``tensorboard``
  extra); otherwise nothing.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moezero.memory.peak import peak_memory_bytes
from moezero.model.decoder import ModelArgs
from moezero.model.moe import MoE
from moezero.model.recompute import recomputing

PEAK_TFLOPS = {  # dense tensor-core peaks from the vendors' data sheets
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
}
"""TFLOP/s by a substring of ``torch.cuda.get_device_name`` (first match wins) and dtype."""


class ExpertLoad:
    """Tokens per expert and dropped assignments of every MoE layer, per optimizer step."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.names = [name for name, m in model.named_modules() if isinstance(m, MoE)]
        layers = [m for m in model.modules() if isinstance(m, MoE)]
        experts = layers[0].num_experts if layers else 0
        self.acc = torch.zeros(len(layers), experts + 1, dtype=torch.int64, device=device)
        self.active = True
        for i, layer in enumerate(layers):
            layer.register_forward_hook(lambda m, a, out, i=i: self._add(i, m))

    def _add(self, i: int, layer: MoE) -> None:
        stats = layer.last_stats
        if self.active and stats and not recomputing():  # activation checkpointing's 2nd pass
            self.acc[i, :-1] += stats["tokens_per_expert"].to(self.acc.device)
            self.acc[i, -1] += stats["dropped"].to(self.acc.device)

    @contextmanager
    def paused(self):
        """Forwards inside (validation) are not counted."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def collect(self, distributed: bool) -> list[dict]:
        """This step's per-layer load summed over all ranks (collective when distributed);
        the counters start again from zero."""
        total = self.acc.clone()
        self.acc.zero_()
        if distributed and total.numel():
            dist.all_reduce(total)
        return [layer_load(name, row[:-1].tolist(), int(row[-1]))
                for name, row in zip(self.names, total.cpu(), strict=True)]


def layer_load(name: str, tokens_E: list[int], dropped: int) -> dict:
    """One layer's row: tokens per expert, dropped fraction, imbalance (max / mean)."""
    kept = sum(tokens_E)
    mean = kept / len(tokens_E) if tokens_E else 0.0
    return {"layer": name, "tokens_per_expert": tokens_E,
            "dropped_frac": dropped / (kept + dropped) if kept + dropped else 0.0,
            "imbalance": max(tokens_E) / mean if mean else None}


class LoadWatch:
    """Warns once per MoE layer when its router starves an expert or loads one expert far
    more than the mean, for ``dead_steps`` consecutive steps (``telemetry`` config section)."""

    def __init__(self, dead_steps: int, max_imbalance: float):
        self.dead_steps, self.max_imbalance = dead_steps, max_imbalance
        self.idle: dict[str, list[int]] = {}  # per layer: steps in a row without tokens, by expert
        self.high: dict[str, int] = {}  # per layer: steps in a row above max_imbalance
        self.warned: set[str] = set()

    def update(self, step: int, layers: list[dict]) -> list[str]:
        """This step's per-layer loads (``layer_load`` rows); the warnings due now."""
        lines = []
        for layer in layers:
            name, tokens = layer["layer"], layer["tokens_per_expert"]
            idle = self.idle.get(name, [0] * len(tokens))
            self.idle[name] = idle = [n + 1 if t == 0 else 0
                                      for n, t in zip(idle, tokens, strict=True)]
            over = layer["imbalance"] is not None and layer["imbalance"] > self.max_imbalance
            self.high[name] = self.high.get(name, 0) + 1 if over else 0
            if self.dead_steps and name not in self.warned:
                line = self._warning(step, name, idle, layer["imbalance"])
                if line:
                    self.warned.add(name)
                    lines.append(line)
        return lines

    def _warning(self, step: int, name: str, idle: list[int], imbalance: float | None) -> str:
        dead = [str(e) for e, n in enumerate(idle) if n >= self.dead_steps]
        tail = (" (router collapse? expert_load.png shows the load; docs/finetune.md, "
                "'Expert load')")
        if dead:
            return (f"moezero: warning: step {step}: {name}: expert{'s' * (len(dead) > 1)} "
                    f"{', '.join(dead)} received no tokens for {self.dead_steps} steps{tail}")
        if self.high[name] >= self.dead_steps:
            return (f"moezero: warning: step {step}: {name}: expert imbalance {imbalance:.2f} "
                    f"(max / mean tokens) above {self.max_imbalance:g} for {self.dead_steps} "
                    f"steps{tail}")
        return ""


class PeakMemory:
    """Peak memory of a window (one step): reset, run, read."""

    def __init__(self, device: torch.device):
        self.device = device
        self.resettable = device.type == "cuda"

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:  # "5": reset the peak RSS to the current RSS (Linux >= 4.0, proc(5))
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.resettable = True
        except OSError:
            self.resettable = False

    def peak(self) -> int:
        """Bytes: CUDA max allocated since the reset; CPU peak RSS since the reset (or since
        start where it cannot be reset)."""
        return peak_memory_bytes(self.device)


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the parameters a token uses (attention, its top-k
    experts and router or a dense layer's MLP, output head; not the embedding lookup) plus the attention-score term
    12 x layers x dim x seq_len (PaLM's appendix B accounting, causal mask not discounted);
    gated DeltaNet layers have no score term but their rule's (``_gated_delta_flops``)."""
    d, f, dense = args.dim, args.ffn_dim, args.first_k_dense
    attn, scores = _attention_flops(args)
    per_layer = attn + args.top_k * 3 * d * f + d * args.num_experts
    dense_layer = attn + 3 * d * args.dense_hidden  # model.first_k_dense layers
    active = (args.n_layers - dense) * per_layer + dense * dense_layer + args.vocab_size * d
    linear = len(args.gated_delta_layers)
    return (6.0 * active + 6.0 * (args.n_layers - linear) * scores * seq_len
            + linear * _gated_delta_flops(args))


def _attention_flops(args: ModelArgs) -> tuple[int, int]:
    """(attention's parameters a token uses, its score width): 4 D² and 2 D for ``gqa``;
    for ``mla`` its projections' sizes and H·(Q + V) (q·k over Q dims, probs·v over V)."""
    d, h = args.dim, args.n_heads
    if args.attention != "mla":
        return 4 * d * d, 2 * d
    q, c, v = args.qk_nope_head_dim + args.qk_rope_head_dim, args.kv_lora_rank, args.v_head_dim
    rank = args.q_lora_rank
    queries = d * h * q if rank is None else d * rank + rank * h * q
    latent = d * (c + args.qk_rope_head_dim) + c * h * (args.qk_nope_head_dim + v)
    return queries + latent + h * v * d, h * (q + v)


def _gated_delta_flops(args: ModelArgs) -> float:
    """A gated DeltaNet layer's training FLOPs per token beyond the 4 D² ``flops_per_token``
    counts for every layer's attention: its own projections and conv instead of those, and
    the chunked rule (per value head: the chunk's q·k and k·k products and the triangular
    solves, 2·chunk·(3K + 2V), and the state's reads and update, 6KV), each 6× (forward and
    backward multiply-adds)."""
    g, h, d = args.linear_num_key_heads, args.linear_num_value_heads, args.dim
    kd, vd, c = args.linear_key_head_dim, args.linear_value_head_dim, args.gated_delta_chunk
    channels = 2 * g * kd + h * vd
    params = d * (channels + h * vd + 2 * h) + h * vd * d + channels * args.linear_conv_kernel_dim
    rule = h * (c * (3 * kd + 2 * vd) + 3 * kd * vd)
    return 6.0 * (params - 4 * d * d + rule)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s for ``dtype``, or None when unknown (CPUs, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    kind = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks[kind] * 1e12
    return None


class TensorBoard:
    """Rank 0's scalars as TensorBoard event files, when ``tensorboard`` is installed."""

    def __init__(self, folder: Path | None):
        self.writer = None
        if folder is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # the optional extra is not installed: nothing to write
            return
        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, row: dict) -> None:
        if self.writer is None:
            return
        step = row["step"]
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"train/{key}" if not key.startswith("val") else
                                       f"val/{key}", value, step)
        for layer in row.get("moe") or []:
            for key in ("dropped_frac", "imbalance"):
                if layer[key] is not None:
                    self.writer.add_scalar(f"moe/{layer['layer']}/{key}", layer[key], step)

    def figure(self, tag: str, fig, step: int) -> None:
        """A matplotlib figure as an image (the expert-load plot)."""
        if self.writer is not None:
            self.writer.add_figure(tag, fig, step, close=False)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class StepTelemetry:
    """What the trainer adds to each step's metrics row: expert load, this step's peak memory,
    MFU; and the TensorBoard writer (rank 0 only)."""

    def __init__(self, engine, args: ModelArgs, seq_len: int, tensorboard: Path | None,
                 watch: LoadWatch | None = None):
        self.load = ExpertLoad(engine.model, engine.device)
        self.watch = watch or LoadWatch(0, float("inf"))
        self.memory = PeakMemory(engine.device)
        self.flops_per_token = flops_per_token(args, seq_len)
        self.peak_flops = peak_flops(engine.device, engine.dtype)
        self.distributed = engine.topology.distributed
        self.tensorboard = TensorBoard(tensorboard)

    def begin_step(self) -> None:
        self.memory.reset()

    def end_step(self, row: dict) -> dict:
        """``row`` with ``peak_mem_bytes`` of this step, ``mfu``, the MoE load and the load
        ``warnings`` due at this step (collective: every rank calls it once per step)."""
        layers = self.load.collect(self.distributed)
        warnings = self.watch.update(row["step"], layers)
        imbalance = [x["imbalance"] for x in layers if x["imbalance"] is not None]
        achieved = row["tokens_per_s"] * self.flops_per_token
        return {**row, "peak_mem_bytes": self.memory.peak(),
                "mfu": achieved / self.peak_flops if self.peak_flops else None,
                "moe_imbalance_max": max(imbalance) if imbalance else None,
                "moe_dropped_frac": sum(x["dropped_frac"] for x in layers) / max(1, len(layers)),
                "moe": layers, "warnings": warnings}

    def close(self) -> None:
        self.tensorboard.close()
