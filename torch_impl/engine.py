"""The training engine: ``initialize(model, config)`` and the data-parallel step.

The engine owns the model, the plan's optimizer groups, the step counters, the loss scaler and
*one* optimizer chosen at construction for ``zero_optimization.stage``
(``moezero.zero.build.build_optimizer``): the replicated optimizer of stage 0 (plain data
parallelism, every rank holding the whole fp32 state) or the sharded one of stages 1-3
(``moezero.zero.sharded``). Both have one interface (``moezero.zero.optimizer.Optimizer``):
backward hooks, ``reduce_gradients``, ``step`` (upcast -> unscale -> clip -> AdamW on the fp32
master -> downcast, one optimizer group at a time; with ``zero_optimization.tiled_step: false``
every group is upcast first, bit for bit the same), ``zero_grad``, the shards a checkpoint
saves and the targets it loads. Checkpoints (``moezero.checkpoint.core.Checkpointer``) receive
those shards, the layout and ``state_dict()``, never the engine. Reference counterpart:
``reference/optim.py``.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moezero.checkpoint import adapter_ckpt
from moezero.checkpoint.core import Checkpointer, model_shapes
from moezero.checkpoint.model_buffers import buffer_shapes, buffer_targets, buffer_values
from moezero.checkpoint.options import CheckpointOptions
from moezero.config import Config
from moezero.distributed.agree import all_gather_json
from moezero.distributed.topology import Topology, build_topology
from moezero.memory.peak import peak_memory_bytes
from moezero.model import determinism
from moezero.model.materialize import KeyedInit, materialize
from moezero.model.moe import expert_tag
from moezero.model.packing import Batch
from moezero.model.recompute import checkpoint_blocks
from moezero.model.router import update_expert_biases
from moezero.offload import state as offload_state
from moezero.offload.malloc import map_large_blocks, release_free
from moezero.offload.options import IOOptions
from moezero.phases import StepPhases
from moezero.plan import plan_layout, store
from moezero.plan.records import EngineRecord, TopologyRecord
from moezero.zero.adamw import LossScaler, lr_at
from moezero.zero.build import build_optimizer
from moezero.zero.groups import OptimizerGroups, build_groups, check_digests, plan_digest
from moezero.zero.lr_schedule import scheduled_lr
from moezero.zero.transfer import batch_to_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs that support it, fp32 elsewhere (CPU bf16 is ~7x slower here)."""
    cuda = device.type == "cuda"
    return DTYPES[cfg.precision.resolve(cuda=cuda, bf16_supported=cuda and torch.cuda.is_bf16_supported())]


def check_supported(cfg: Config, *, numel: int = 0, share: float = 1.0,
                    device: torch.device | None = None, frozen: int = 0) -> None:
    """Checks the CLI runs before any rank starts: NVMe swap folders exist, are writable
    and have room for this node's ``share`` of the model's swap files, sized with the params'
    dtype on ``device`` (``auto`` is bf16 on GPUs). ``frozen`` of the ``numel`` elements (a
    LoRA base) have no optimizer state, and no param swap file where the base is read in
    place (``offload.base_params``). One-line ``ConfigError``; nothing is written. Ranks
    check their exact sizes again."""
    in_place = cfg.peft.uses_lora and cfg.checkpoint.load is not None
    offload_state.check_paths(cfg.zero_optimization, numel=numel, share=share,
                              param_bytes=resolve_dtype(cfg, device or torch.device("cpu")).itemsize,
                              frozen=frozen, in_place=in_place)


class Engine:
    """Owns the model's optimizer and runs forward/backward/step across ranks.

    ``io`` sets how checkpoints and swap files reach the disk (default ``IOOptions()``).
    ``init`` (sharded construction, ``moezero.model.materialize``): ``model`` is on the meta
    device and this rank materialises only what it keeps, with ``init``'s values.
    """

    def __init__(self, model: nn.Module, cfg: Config, topology: Topology, device: torch.device,
                 io: IOOptions | None = None, init: KeyedInit | None = None,
                 base: Path | None = None):
        self.cfg, self.topology, self.device = cfg, topology, device
        determinism.configure(cfg.train.deterministic, device)
        self.io = io or IOOptions()
        self.dtype = resolve_dtype(cfg, device)
        zero = cfg.zero_optimization
        self.trim_heap = _host_blocks(zero, self.io)
        if init is not None:
            materialize(model, init, device=device, dtype=self.dtype, values=zero.stage < 3)
        self.model = model.to(device=device, dtype=self.dtype)
        if cfg.activation_checkpointing.enabled:
            checkpoint_blocks(self.model, cfg.activation_checkpointing.every_n_layers)
        self.params = dict(self.model.named_parameters())
        self.groups: OptimizerGroups = build_groups(self.model, cfg, topology)
        check_digests(all_gather_json(plan_digest(self.groups), device=device))
        check_supported(cfg, device=device)
        initial = None if init is None or zero.stage < 3 else init.source(
            {fqn: p.shape for fqn, p in self.params.items()}, self.dtype, device)
        self.optimizer = build_optimizer(
            self.params, self.groups, topology, zero, model=self.model, initial=initial,
            swap_factory=lambda slots, meter, frozen=(): offload_state.build(
                zero, slots, topology.rank, self.dtype, meter, self.io, frozen=frozen,
                base=base))
        self.scaler = LossScaler.from_config(cfg.precision)
        self.step_count = 0  # optimizer steps taken (skipped steps excluded)
        self.global_steps = 0  # optimizer_step calls, skipped ones included (checkpoint names)
        self.micro_steps = 0
        self.checkpointer = Checkpointer(topology.rank, topology.world_size,
                                         CheckpointOptions.from_config(cfg.checkpoint, self.io))
        self.shapes = model_shapes(self.model)  # of the global model (every expert)
        self.lora = cfg.peft.uses_lora
        self.base: dict | None = None  # LoRA: the checkpoint holding the frozen base weights
        self.read_in_place = base  # the base step directory frozen params are read from

    @property
    def meter(self):
        """The optimizer's memory accounting (``zero.shards.MemoryMeter``)."""
        return self.optimizer.meter

    # ------------------------------------------------------------------ forward / backward
    def forward(self, batch: torch.Tensor | Batch, divisor: float | None = None):
        """Loss of one micro-batch on this rank and its parts (``ce``, ``aux_loss``,
        ``trained``): a token tensor [B, S+1] or a ``Batch`` with a loss mask and documents
        (``divisor``: the masked cross-entropy's, ``loss_divisor``)."""
        b = Batch.of(batch).apply(lambda t: batch_to_device(t, self.device))
        # only what this batch carries: a user's model with ``loss(tokens)`` still trains
        extra = {k: v for k, v in (("loss_mask_BS", b.loss_mask_BS),
                                   ("documents_BS", b.documents_BS), ("divisor", divisor))
                 if v is not None}
        return self.model.loss(b.tokens_BS1, **extra)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``, averaged over the micro-batches of a step and loss-scaled."""
        accum = self.cfg.train.grad_accum_steps
        self.optimizer.before_backward(final=self.micro_steps + 1 >= accum)
        (loss * (self.scaler.scale / accum)).backward()
        self.optimizer.after_backward()
        self.micro_steps += 1

    # ------------------------------------------------------------------ step
    def step(self) -> dict:
        """Reduce gradients, clip, and step every group; returns this step's optimizer metrics."""
        self.reduce_gradients()
        return self.optimizer_step()

    def reduce_gradients(self) -> None:
        """Sum over each parameter's data-parallel group, divide by W (docs/design.md, "Semantics")."""
        self.optimizer.reduce_gradients()

    def optimizer_step(self) -> dict:
        """Clip and step every group on already-reduced gradients, then drop the gradients.

        An overflow (a non-finite gradient on any rank) skips the step on every rank.
        """
        lr, opt = self.current_lr(), self.cfg.optimizer
        grad_norm, overflow = self.optimizer.step(
            lr=lr, scale=self.scaler.scale, max_norm=opt.max_grad_norm, step=self.step_count + 1,
            betas=opt.betas, eps=opt.eps, tiled=self.cfg.zero_optimization.tiled_step)
        self.optimizer.zero_grad()
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

        For tests and debugging; collective at stages 1-3 (it all-gathers the partitions).
        Call between ``reduce_gradients`` and ``optimizer_step``.
        """
        return self.optimizer.full_gradients()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's params by FQN, full size: the params themselves, or at stage 3 copies
        gathered from the shards (collective there)."""
        return self.optimizer.full_parameters()

    def current_lr(self) -> float:
        """The lr of the next optimizer step: ``optimizer.scheduler``'s (a DeepSpeed schedule)
        where set, else moezero's warmup + cosine."""
        opt = self.cfg.optimizer
        if opt.scheduler is not None:
            return scheduled_lr(opt.scheduler, self.step_count, peak=opt.lr)
        return lr_at(self.step_count, lr=opt.lr, warmup_steps=opt.warmup_steps,
                     total_steps=self.cfg.train.steps, min_lr_ratio=opt.min_lr_ratio)

    def train_step(self, micro_batches: list[torch.Tensor | Batch]) -> dict:
        """One optimizer step over ``grad_accum_steps`` micro-batches; metrics averaged globally.
        ``tokens_per_s`` counts this rank's targets, ``trained_tokens_per_s`` those trained."""
        start, clock = time.perf_counter(), StepPhases(self.optimizer.swap_traffic)
        micro_batches = [Batch.of(b) for b in micro_batches]
        divisor = loss_divisor(micro_batches, self.topology, self.device)
        totals = torch.zeros(3, device=self.device)
        queued = [b.apply(lambda t: batch_to_device(t, self.device))  # no host drain
                  for b in micro_batches]
        for batch in queued:
            loss, parts = self.forward(batch, divisor)
            clock.mark("forward")
            self.backward(loss)
            totals += torch.stack([loss.detach().float(), parts["ce"], parts["aux_loss"]])
            clock.mark("backward")
        # Reduce first: ranks may still have gradient buckets to launch on the world group.
        self.reduce_gradients()
        clock.mark("reduce")
        totals /= len(micro_batches)
        if self.topology.distributed:
            dist.all_reduce(totals)
            totals /= self.topology.world_size
        out = self.optimizer_step()
        if self.trim_heap:  # offloaded tiers: the step's freed host blocks back to the OS
            release_free()
        clock.mark("step")
        elapsed = time.perf_counter() - start
        seen, trained = (sum(b.num_seen for b in micro_batches),
                         sum(b.num_trained for b in micro_batches))
        return {"loss": totals[0].item(), "ce": totals[1].item(), "aux_loss": totals[2].item(),
                **out, "tokens_per_s": seen / elapsed, "trained_tokens_per_s": trained / elapsed,
                "step_time_s": elapsed,
                "peak_mem_bytes": peak_memory_bytes(self.device),
                **clock.metrics()}

    # ------------------------------------------------------------------ small state
    def state_dict(self) -> dict:
        """The engine's small state (JSON): counters and loss scaler (``engine``, an
        ``EngineRecord``) and this rank's generator states (``rng``)."""
        record = EngineRecord(self.step_count, self.global_steps, self.current_lr(),
                              self.scaler.state_dict())
        return {"engine": record.to_json(), "rng": _rng_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s counters, loss scaler and RNG; what ``state`` lacks
        (e.g. {} after a weights-only load) restarts the counters at 0 and leaves the rest."""
        record = EngineRecord.from_json(state.get("engine"))
        self.step_count, self.global_steps = record.step_count, record.global_steps
        if record.loss_scaler is not None:
            self.scaler.load_state_dict(record.loss_scaler)
        if state.get("rng"):
            _set_rng_state(state["rng"])

    def topology_record(self) -> TopologyRecord:
        """How this run is laid out, for the manifest."""
        zero, moe = self.cfg.zero_optimization, self.cfg.moe
        return TopologyRecord(self.topology.world_size, tuple(self.topology.ep_sizes),
                              zero.stage, str(self.dtype).removeprefix("torch."),
                              moe.max_group_size, moe.split_groups_by_expert,
                              offload_optimizer=zero.offload_optimizer.device,
                              split_dense_by_layer=moe.split_dense_by_layer)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, root, *, state: dict | None = None, step: int | None = None,
                        background: bool | None = None):
        """Save under ``root/step_XXXXXXXX/`` (collective; docs/checkpoint.md).

        ``step`` defaults to ``global_steps``; ``state`` is the caller's JSON (e.g. the data
        position), returned by ``load_checkpoint``; ``background`` defaults to
        ``checkpoint.async`` (then call ``wait_checkpoint`` before exiting).
        """
        step = self.global_steps if step is None else step
        meta = {"config": self.cfg.model_dump(by_alias=True, mode="json"),
                "topology": self.topology_record().to_json()}
        groups, shapes = self.groups.plan, self.shapes
        if self.base is not None:  # the adapters only, and where the base weights are
            split = adapter_ckpt.AdapterPlan.of(groups, shapes)
            groups, shapes, meta["base"] = split.groups, split.trained, self.base
        layout = plan_layout(groups, shapes, step=step, buffers=buffer_shapes(self.model))
        values = buffer_values(self.model) if self.topology.rank == 0 else {}
        return self.checkpointer.save(
            root, step=step, layout=layout, shards=self.optimizer.shards(frozen=self.base is None),
            state={**self.state_dict(), "client": state or {}}, meta=meta, buffers=values,
            background=background)

    def wait_checkpoint(self):
        """Finish an async save in flight (raises its error); its directory or None."""
        return self.checkpointer.wait()

    def load_checkpoint(self, path) -> dict:
        """Load a step directory or a root's newest complete checkpoint (collective): the
        fp32 master and moments of this rank's state, the params derived from the master,
        the counters, loss scaler and RNG. A weights-only checkpoint (``moezero
        import-hf``) sets the masters only: zero moments, counters at 0, RNG and loss scaler
        as they are (a fine-tune from step 0). Returns the caller state given at save.
        LoRA: see ``_load_lora``."""
        if self.lora:
            state = self._load_lora(path, buffer_targets(self.model))
        else:
            state = self.checkpointer.load(path, self.optimizer.load_targets(), self.shapes,
                                           buffers=buffer_targets(self.model))
        self.optimizer.after_load()
        self.load_state_dict(state)
        where = store.find_checkpoint(path).resolve()
        if self.base is None or self.base["path"] != str(where):  # resumed, not a new base
            self.checkpointer.adopt(where)
        return state.get("client", {})

    def _load_lora(self, path, buffers: dict) -> dict:
        """An adapter checkpoint: the frozen params from its base (checked unchanged), the
        rest from it. Any other checkpoint becomes the base of this run's saves; the adapters
        come from it too, or keep their initial values where it has none (a fine-tune from
        step 0: returns {}); then every other param comes from it, the base params that
        ``train.freeze``'s "!" patterns train too included (their masters; moments zero)."""
        where = store.find_checkpoint(path)
        manifest = store.read_manifest(where)
        split, load = adapter_ckpt.AdapterPlan.of(self.groups.plan, self.shapes), \
            self.checkpointer.load
        frozen, trained = (self.optimizer.load_targets(trained=False),
                           self.optimizer.load_targets(frozen=False))
        if manifest.base:
            source = adapter_ckpt.check(manifest.base, where)
            adapter_ckpt.check_same(self.read_in_place, source)
            load(source, frozen, split.frozen, exact=False)
            self.base = manifest.base
            return load(where, trained, split.trained, buffers=buffers)
        self.base = adapter_ckpt.record(where)
        adapter_ckpt.check_same(self.read_in_place, where)
        if split.lacks_adapters(dict(manifest.layout.shapes)):
            load(where, frozen, split.frozen, buffers=buffers, exact=False)
            if split.unfrozen:  # base params trained too ("!" patterns): their values
                load(where, self.optimizer.load_targets(frozen=False), split.unfrozen,
                     exact=False, only=True)
            return {}
        return load(where, self.optimizer.load_targets(), self.shapes, buffers=buffers)

    def close(self) -> None:
        """Finish an async save and release offload resources (swap files are removed)."""
        self.checkpointer.wait()
        self.optimizer.close()


def loss_divisor(micro_batches: list[Batch], topology: Topology,
                 device: torch.device) -> float | None:
    """The masked cross-entropy's divisor of this step: the trained targets of the global
    batch (all ranks, all micro-batches: one all-reduce) over ``W · micro-batches``, so that
    after the backward's 1/accum and the reduction's 1/W the gradient is that of Σ loss / count
    over the global batch (docs/data.md). None when no batch has a loss mask (plain means)."""
    if all(b.loss_mask_BS is None for b in micro_batches):
        return None
    count = torch.tensor(float(sum(b.num_trained for b in micro_batches)), dtype=torch.float64,
                         device=device)
    if topology.distributed:
        dist.all_reduce(count)
    return max(count.item(), 1.0) / (topology.world_size * len(micro_batches))


def _rng_state() -> dict:
    b64 = lambda t: base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")
    state = {"torch_cpu": b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = b64(torch.cuda.get_rng_state())
    return state


def _set_rng_state(state: dict) -> None:
    unb64 = lambda s: torch.from_numpy(np.frombuffer(base64.b64decode(s), np.uint8).copy())
    torch.set_rng_state(unb64(state["torch_cpu"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(unb64(state["torch_cuda"]))


def _host_blocks(zero, io: IOOptions) -> bool:
    """With an offloaded tier, glibc maps large host blocks and unmaps them when freed
    (``IOOptions.host_mmap_threshold``; ``moezero.offload.malloc``); True then: the engine
    also returns the arenas' free pages after each step (``release_free``)."""
    offloaded = zero.offload_optimizer.device != "none" or zero.offload_param.device != "none"
    if offloaded and io.host_mmap_threshold is not None:
        map_large_blocks(io.host_mmap_threshold)
        return True
    return False


def initialize(model: nn.Module, config: Config, *, topology: Topology | None = None,
               device: torch.device | str | None = None, io: IOOptions | None = None,
               init: KeyedInit | None = None, base: Path | None = None) -> Engine:
    """Wrap ``model`` (already holding its MoE layers' EP groups) in a training engine.

    ``topology`` defaults to one built from the model's MoE layers; ``device`` to CUDA when
    available (this rank's local device), else CPU; ``io`` to ``IOOptions()``; ``init``: the
    model is on the meta device, materialised by the engine (sharded construction);
    ``base``: a LoRA run's base step directory (``adapter_ckpt.frozen_source``), whose files
    stage 3 with ``offload_param.device: nvme`` reads the frozen params from, in place.
    """
    if topology is None:
        eps = sorted({t.ep_size for p in model.parameters() if (t := expert_tag(p))} or {1})
        topology = build_topology(eps, num_experts=config.moe.num_experts)
    if device is None:
        device = torch.device(f"cuda:{torch.cuda.current_device()}"
                              if torch.cuda.is_available() else "cpu")
    return Engine(model, config, topology, torch.device(device), io, init, base)
