"""The training engine: ``initialize(model, config)`` and the data-parallel step.

``zero_optimization.stage`` 0 is plain data parallelism with replicated fp32 optimizer state:
dense gradients are averaged over the W ranks, expert gradients summed over their EDP group and
divided by W, so every rank computes the gradient of the *global* mean loss (DESIGN.md §2).
The step then runs the plan's optimizer groups one at a time: upcast -> unscale -> clip ->
AdamW on the fp32 master -> downcast. Stages 1 and 2 shard the optimizer state (and, at 2,
the gradients) over each group's data-parallel ranks: ``moezero.zero.sharded``. With
``zero_optimization.tiled_step: false`` every group is upcast first (same results, bit for
bit; more memory). Reference counterpart: ``reference/optim.py``.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moezero.checkpoint import core as checkpoint
from moezero.config import Config
from moezero.distributed.topology import Topology, build_topology
from moezero.model.moe import expert_tag
from moezero.model.router import update_expert_biases
from moezero.offload import state as offload_state
from moezero.zero.adamw import LossScaler, adamw_, clip_coef, lr_at
from moezero.zero.groups import OptimizerGroups, build_groups
from moezero.zero.sharded import ADAMW_TEMPORARIES, MemoryMeter, ZeroOptimizer, nbytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs that support it, fp32 elsewhere (CPU bf16 is ~7x slower here)."""
    cuda = device.type == "cuda"
    return DTYPES[cfg.precision.resolve(cuda=cuda, bf16_supported=cuda and torch.cuda.is_bf16_supported())]


@dataclass
class _ParamState:
    """fp32 master (the parameter itself in fp32 runs) and the two Adam moments."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


def check_supported(cfg: Config, *, numel: int = 0, share: float = 1.0) -> None:
    """Checks the CLI runs before any rank starts: NVMe swap folders exist, are writable
    and have room for this node's ``share`` of the model's swap files. One-line
    ``ConfigError``; nothing is written. Ranks check their exact sizes again."""
    offload_state.check_paths(cfg.zero_optimization, numel=numel, share=share,
                              param_bytes=2 if cfg.precision.dtype in ("bf16", "fp16") else 4)


class Engine:
    """Owns the model's optimizer state and runs forward/backward/step across ranks."""

    def __init__(self, model: nn.Module, cfg: Config, topology: Topology, device: torch.device):
        self.cfg, self.topology, self.device = cfg, topology, device
        self.dtype = resolve_dtype(cfg, device)
        self.model = model.to(device=device, dtype=self.dtype)
        self.params = dict(self.model.named_parameters())
        self.groups: OptimizerGroups = build_groups(self.model, cfg, topology)
        check_supported(cfg)
        zero = cfg.zero_optimization
        self.zero: ZeroOptimizer | None = None
        self.state: dict[str, _ParamState] = {}
        if zero.stage == 0:
            self.state = {fqn: self._new_state(p) for fqn, p in self.params.items()}
            self.meter = _stage0_meter(self.params, self.state)
        else:
            host = torch.device("cpu")
            self.zero = ZeroOptimizer(
                self.params, self.groups, topology, stage=zero.stage,
                bucket_size=zero.reduce_bucket_size, overlap=zero.overlap_comm, model=self.model,
                state_device=host if zero.offload_optimizer.device != "none" else device,
                param_device=host if zero.offload_param.device != "none" else device,
                swap_factory=lambda slots, meter: offload_state.build(
                    zero, slots, topology.rank, self.dtype, meter))
            self.meter = self.zero.meter
        self.scaler = LossScaler.from_config(cfg.precision)
        self.step_count = 0  # optimizer steps taken (skipped steps excluded)
        self.global_steps = 0  # optimizer_step calls, skipped ones included (checkpoint names)
        self.micro_steps = 0
        self.checkpointer = checkpoint.Checkpointer(topology.rank, topology.world_size, self.model)

    def _new_state(self, param: nn.Parameter) -> _ParamState:
        master = param.data if param.dtype == torch.float32 else param.detach().float()
        return _ParamState(master, torch.zeros_like(master), torch.zeros_like(master))

    # ------------------------------------------------------------------ forward / backward
    def forward(self, batch_BS1: torch.Tensor):
        """Loss of one micro-batch on this rank and its parts (``ce``, ``aux_loss``)."""
        return self.model.loss(batch_BS1.to(self.device))

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``, averaged over the micro-batches of a step and loss-scaled."""
        accum = self.cfg.train.grad_accum_steps
        if self.zero is not None:
            self.zero.before_backward(final=self.micro_steps + 1 >= accum)
        (loss * (self.scaler.scale / accum)).backward()
        if self.zero is not None:
            self.zero.after_backward()
        self.micro_steps += 1

    # ------------------------------------------------------------------ step
    def step(self) -> dict:
        """Reduce gradients, clip, and step every group; returns this step's optimizer metrics."""
        self.reduce_gradients()
        return self.optimizer_step()

    def optimizer_step(self) -> dict:
        """Clip and step every group on already-reduced gradients, then drop the gradients.

        An overflow (a non-finite gradient on any rank) skips the step on every rank.
        """
        lr = self.current_lr()
        if self.zero is not None:
            opt = self.cfg.optimizer
            grad_norm, overflow = self.zero.step(
                lr=lr, scale=self.scaler.scale, max_norm=opt.max_grad_norm,
                step=self.step_count + 1, betas=opt.betas, eps=opt.eps,
                tiled=self.cfg.zero_optimization.tiled_step)
            self.zero.zero_grad()
        else:
            self.meter.start()
            sq, nonfinite = self._grad_square_sum()
            overflow = nonfinite > 0
            grad_norm = math.sqrt(sq) / self.scaler.scale if not overflow else float("inf")
            if not overflow:
                self._apply(lr, clip_coef(grad_norm, self.cfg.optimizer.max_grad_norm))
            for p in self.params.values():
                p.grad = None
        if not overflow:
            self.step_count += 1
        # The aux-loss-free expert biases (if any) step outside the optimizer, on global loads.
        update_expert_biases(self.model, distributed=self.topology.distributed, skip=overflow)
        self.global_steps += 1
        self.scaler.update(overflow)
        self.micro_steps = 0
        return {"lr": lr, "grad_norm": grad_norm, "loss_scale": self.scaler.scale,
                "skipped": bool(overflow), "step_peak_engine_bytes": self.meter.peak}

    def gradients(self) -> dict[str, torch.Tensor]:
        """The reduced gradients of this rank's params by FQN, full size.

        For tests and debugging; collective at stages 1-2 (it all-gathers the partitions).
        Call between ``reduce_gradients`` and ``optimizer_step``.
        """
        if self.zero is not None:
            return self.zero.full_gradients()
        return {fqn: p.grad for fqn, p in self.params.items()}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's params by FQN, full size: the params themselves, or at stage 3 copies
        gathered from the shards (collective there)."""
        if self.zero is not None:
            return self.zero.full_parameters()
        return dict(self.params)

    def current_lr(self) -> float:
        opt = self.cfg.optimizer
        return lr_at(self.step_count, lr=opt.lr, warmup_steps=opt.warmup_steps,
                     total_steps=self.cfg.train.steps, min_lr_ratio=opt.min_lr_ratio)

    def train_step(self, micro_batches: list[torch.Tensor]) -> dict:
        """One optimizer step over ``grad_accum_steps`` micro-batches; metrics averaged globally."""
        start = time.perf_counter()
        totals = torch.zeros(3, device=self.device)
        for batch in micro_batches:
            loss, parts = self.forward(batch)
            self.backward(loss)
            totals += torch.stack([loss.detach().float(), parts["ce"], parts["aux_loss"]])
        # Reduce first: ranks may still have gradient buckets to launch on the world group.
        self.reduce_gradients()
        totals /= len(micro_batches)
        if self.topology.distributed:
            dist.all_reduce(totals)
            totals /= self.topology.world_size
        out = self.optimizer_step()
        elapsed = time.perf_counter() - start
        tokens = sum(b[:, 1:].numel() for b in micro_batches)
        return {"loss": totals[0].item(), "ce": totals[1].item(), "aux_loss": totals[2].item(),
                **out, "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
                "peak_mem_bytes": peak_memory_bytes(self.device)}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, root, *, state: dict | None = None, step: int | None = None,
                        background: bool | None = None):
        """Save under ``root/step_XXXXXXXX/`` (collective; docs/checkpoint.md).

        ``step`` defaults to ``global_steps``; ``state`` is the caller's JSON (e.g. the data
        position), returned by ``load_checkpoint``; ``background`` defaults to
        ``checkpoint.async`` (then call ``wait_checkpoint`` before exiting).
        """
        step = self.global_steps if step is None else step
        return checkpoint.save(self, root, step=step, state=state, background=background)

    def wait_checkpoint(self):
        """Finish an async save in flight (raises its error); its directory or None."""
        return self.checkpointer.wait()

    def close(self) -> None:
        """Finish an async save and release offload resources (swap files are removed)."""
        self.checkpointer.wait()
        if self.zero is not None:
            self.zero.close()

    def load_checkpoint(self, path) -> dict:
        """Load a step directory or a root's newest complete checkpoint (collective);
        returns the caller state given at save."""
        return checkpoint.load(self, path)

    # ------------------------------------------------------------------ internals
    def _grads(self, expert: bool, ep: int | None = None) -> list[torch.Tensor]:
        out = []
        for p in self.params.values():
            tag = expert_tag(p)
            if (tag is not None) != expert or (expert and tag.ep_size != ep):
                continue
            if p.grad is None:  # e.g. an expert that saw no token: its gradient is zero
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def reduce_gradients(self) -> None:
        """Sum over each parameter's data-parallel group, divide by W (DESIGN.md §2)."""
        if self.zero is not None:
            self.zero.reduce_gradients()
            return
        topo = self.topology
        _all_reduce_mean(self._grads(False), None, topo)
        for ep in topo.ep_sizes:
            _all_reduce_mean(self._grads(True, ep), topo.edp_group(ep), topo)

    def _grad_square_sum(self) -> tuple[float, float]:
        """Global sum of squared (scaled) gradients, each element counted once, and a
        non-finite flag, in one all-reduce over all ranks."""
        topo = self.topology
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        for p in self.params.values():
            tag = expert_tag(p)
            owner = topo.rank == 0 if tag is None else topo.edp_rank(tag.ep_size) == 0
            g = p.grad.float()
            if owner:
                acc[0] += g.square().sum(dtype=torch.float64)
            acc[1] += (~torch.isfinite(g)).sum()
        if topo.distributed:
            dist.all_reduce(acc)
        return acc[0].item(), acc[1].item()

    def _apply(self, lr: float, clip: float) -> None:
        """The step one optimizer group at a time: only that group's fp32 gradients exist
        (``tiled_step``), or every group upcast first (untiled; the same numbers)."""
        slices = [(g.hparams, sl) for g in self.groups.local for sl in g.members]
        upcast = None
        if not self.cfg.zero_optimization.tiled_step:
            upcast = [self._upcast(sl) for _, sl in slices]
        for i, (hp, sl) in enumerate(slices):
            g32, held = upcast[i] if upcast is not None else self._upcast(sl)
            if upcast is not None:
                upcast[i] = None
            self._apply_slice(g32, hp, sl, lr, clip)
            self.meter.drop(held)

    def _upcast(self, sl) -> tuple[torch.Tensor, int]:
        """The slice's gradient in fp32 and the bytes that took (0: fp32 grads are used as is)."""
        grad = self.params[sl.fqn].grad.reshape(-1)[sl.start:sl.stop]
        g32 = grad.float()
        held = 0 if g32 is grad else nbytes(g32)
        self.meter.hold(held)
        return g32, held

    def _apply_slice(self, g32: torch.Tensor, hp: dict, sl, lr: float, clip: float) -> None:
        opt = self.cfg.optimizer
        param, st = self.params[sl.fqn], self.state[sl.fqn]
        g32.mul_(1.0 / self.scaler.scale).mul_(clip)
        master = st.master.view(-1)[sl.start:sl.stop]
        self.meter.hold(ADAMW_TEMPORARIES * nbytes(g32))
        adamw_(master, g32, st.exp_avg.view(-1)[sl.start:sl.stop],
               st.exp_avg_sq.view(-1)[sl.start:sl.stop], step=self.step_count + 1,
               lr=lr * hp.get("lr_scale", 1.0), beta1=opt.betas[0], beta2=opt.betas[1],
               eps=opt.eps, weight_decay=hp.get("weight_decay", 0.0))
        self.meter.drop(ADAMW_TEMPORARIES * nbytes(g32))
        if st.master is not param.data:
            param.data.view(-1)[sl.start:sl.stop].copy_(master)


def _stage0_meter(params: dict, state: dict) -> MemoryMeter:
    """Stage 0's persistent bytes: full grads, fp32 masters (unless the params) and moments."""
    meter = MemoryMeter()
    for fqn, p in params.items():
        st = state[fqn]
        meter.add_persistent(p, st.exp_avg, st.exp_avg_sq)  # p: the size of its gradient
        if st.master is not p.data:
            meter.add_persistent(st.master)
    return meter


def _all_reduce_mean(grads: list[torch.Tensor], group, topo: Topology) -> None:
    """All-reduce (sum) a list of gradients in fp32 flat buckets over ``group``, then / W."""
    if not topo.distributed or not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= topo.world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on GPU; the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def initialize(model: nn.Module, config: Config, *, topology: Topology | None = None,
               device: torch.device | str | None = None) -> Engine:
    """Wrap ``model`` (already holding its MoE layers' EP groups) in a training engine.

    ``topology`` defaults to one built from the model's MoE layers; ``device`` to CUDA when
    available (this rank's local device), else CPU.
    """
    if topology is None:
        eps = sorted({t.ep_size for p in model.parameters() if (t := expert_tag(p))} or {1})
        topology = build_topology(eps, num_experts=config.moe.num_experts)
    if device is None:
        device = torch.device(f"cuda:{torch.cuda.current_device()}"
                              if torch.cuda.is_available() else "cpu")
    return Engine(model, config, topology, torch.device(device))
