"""``moezero estimate``: one rank's bytes of training state per tier and its predicted peak,
from the config alone.

Nothing of the model is allocated: the decoder is built on the meta device, its parameter
specs go through the plan (``moezero.plan``: grouping, partition), and each local group's
partition is sized by the engine's placement rules (``_group_bytes``: which of master,
moments, gradient partition and param shard exist and where, as
``moezero.zero.sharded.ShardedOptimizer._init_state`` and
``moezero.zero.replicated.ReplicatedOptimizer`` allocate them; swap files rounded as
``moezero.offload.state.SwapState.nbytes``). The stage-3 gather units come from the same pure
plan the gatherer uses (``moezero.zero.gather.plan_units``). One step's transients by phase
(activations, buckets, gathered units, the step's temporaries) are ``moezero.transients``';
the peak of a tier is its persistent bytes, its largest phase and, on the host, the runtime
(``RUNTIME_BYTES``). Tested against the engine's own ``MemoryMeter`` and swap files
(tests/torch_impl/test_estimate.py) and against measured peaks
(tests/torch_impl/test_estimate_peak.py, the ``estimate`` benchmark series).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from moezero.config import Config
from moezero.distributed.topology import Topology
from moezero.model.build import config_decoder
from moezero.offload.aio import aligned_size
from moezero.offload.state import params_read_master
from moezero.plan.partition import Partition
from moezero.transients import PHASES, StepShape, Transient, activation_bytes, transients
from moezero.zero.gather_units import own_units, param_kind, plan_units, unit_modules
from moezero.zero.groups import plan_model

__all__ = ["Estimate", "activation_bytes", "estimate", "format_table"]

TIERS = ("device", "cpu", "nvme")
CATEGORIES = ("params", "grads", "optimizer")
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
RUNTIME_BYTES = {"cpu": 332 * 2**20}
"""Peak RSS of a training rank apart from its model, state and step (the interpreter, torch,
moezero, gloo, the data pipeline), by compute device kind: measured on CPU as the peak RSS per
rank of ``moezero train`` at W = 2 on a model too small to matter (docs/scale.md, checked by
tests/torch_impl/test_estimate.py). Not measured on CUDA (no GPU here): left out there."""


@dataclass(frozen=True)
class Estimate:
    """Bytes one rank holds, by (category, tier); with ``device='cpu'`` the compute device is
    the host, so everything in memory is in the ``cpu`` tier."""

    world_size: int
    rank: int
    stage: int
    dtype: str
    device: str
    model_numel: int  # the global model, every expert once (adapters included)
    local_numel: int  # elements of this rank's trained optimizer groups (unpadded)
    bytes: tuple[tuple[str, str, int], ...]  # (category, tier, bytes), no zero rows
    gather_unit: str  # the largest stage-3 gather unit ("" below stage 3)
    gather_unit_bytes: int  # its params in the compute dtype, gathered
    activation_bytes: int  # one micro-batch's saved activations
    transients: tuple[Transient, ...] = ()  # one step's, by phase (``moezero.transients``)
    runtime_bytes: int | None = None  # the process itself on the host (RUNTIME_BYTES)
    trained_numel: int | None = None  # of model_numel, the trained (None: all of it)
    frozen: tuple[tuple[str, int], ...] = ()  # (tier, bytes) of this rank's frozen weights
    base_dtype: str | None = None  # the base checkpoint's weights (``bf16``, ``fp32``, ...)
    in_place: bool = False  # the frozen shards on NVMe are the base's own files, not swap

    @property
    def frozen_numel(self) -> int:
        """Params of the model that are frozen (the base under LoRA), every expert once."""
        return self.model_numel - (self.model_numel if self.trained_numel is None
                                   else self.trained_numel)

    def base_disk_bytes(self) -> int:
        """Bytes of the frozen params in the base checkpoint (all ranks'): its dtype's size
        each (``import-hf --dtype``, bf16 when not known), headers aside."""
        return self.frozen_numel * ITEMSIZE[self.base_dtype or "bf16"]

    def get(self, category: str, tier: str) -> int:
        return sum(b for c, t, b in self.bytes if c == category and t == tier)

    def tier_total(self, tier: str) -> int:
        return sum(b for _, t, b in self.bytes if t == tier)

    def memory_total(self) -> int:
        """Persistent bytes in memory (device and host) — the state, not the activations."""
        return self.tier_total("device") + self.tier_total("cpu")

    def phase_total(self, phase: str, tier: str) -> int:
        return sum(t.bytes for t in self.transients if t.phase == phase and t.tier == tier)

    def peak_phase(self, tier: str) -> str:
        """The phase of the step with the most transient bytes in ``tier``."""
        return max(PHASES, key=lambda ph: self.phase_total(ph, tier))

    def peak(self, tier: str) -> int:
        """Predicted peak bytes of ``tier`` (device or cpu): persistent state, the largest
        phase's transients and, on the host, the runtime (when known)."""
        runtime = (self.runtime_bytes or 0) if tier == "cpu" else 0
        return self.tier_total(tier) + self.phase_total(self.peak_phase(tier), tier) + runtime


@dataclass(frozen=True)
class _Placement:
    """Where the engine puts each state, for one config and compute device."""

    stage: int
    itemsize: int
    host: bool  # the compute device is the host (CPU training)
    optimizer: str  # offload_optimizer.device: none | cpu | nvme
    param: str  # offload_param.device (stage 3): none | cpu | nvme
    param_reads_master: bool = False  # offload.state.params_read_master

    def memory(self, tier: str) -> str:
        """The tier a tensor on ``device`` ('none') or the host ('cpu') is reported in."""
        return "cpu" if self.host or tier == "cpu" else "device"

    @property
    def fp32(self) -> bool:
        return self.itemsize == 4

    @property
    def state_on_device(self) -> bool:  # ShardedOptimizer: state_device == the params' device
        return self.host or self.optimizer == "none"

    @property
    def grad_tier(self) -> str:
        """Where the reduced gradient partition (``Slot.grad``) lives: a swap file at stage 3
        with the optimizer on NVMe (``moezero.zero.gradtier``), else memory beside the params."""
        return "nvme" if self.stage == 3 and self.optimizer == "nvme" else self.memory("none")

    @property
    def param_with_state(self) -> bool:  # param_device == state_device
        return self.host or (self.param != "none") == (self.optimizer != "none")


def _frozen_bytes(part: Partition, pl: _Placement) -> Counter:
    """(category, tier) -> bytes of one local frozen group (``train.freeze``, the base under
    LoRA): its weights in the compute dtype only, no gradient, master or moments
    (``zero.sharded._init_frozen_shard``; stages 0-2: its range of the flat params)."""
    if pl.stage < 3:
        return Counter({("params", pl.memory("none")): part.numel * pl.itemsize})
    shard = part.shard_numel * pl.itemsize
    if pl.param == "nvme":
        return Counter({("params", "nvme"): aligned_size(shard)})
    return Counter({("params", pl.memory(pl.param)): shard})


def _group_bytes(part: Partition, pl: _Placement) -> Counter:
    """(category, tier) -> bytes of one local trained group (``part``) on this rank."""
    out: Counter = Counter()
    dev = pl.memory("none")
    if pl.stage == 0:  # replicated: flat params and grads, fp32 master unless it is the params
        out["params", dev] += part.numel * pl.itemsize
        out["grads", dev] += part.numel * pl.itemsize
        out["optimizer", dev] += part.numel * 4 * (2 if pl.fp32 else 3)
        return out
    shard = part.shard_numel
    grad = shard * pl.itemsize  # the reduced gradient partition (a swap file: zero.gradtier)
    out["grads", pl.grad_tier] += aligned_size(grad) if pl.grad_tier == "nvme" else grad
    if pl.stage < 3:
        out["params", dev] += part.numel * pl.itemsize  # the flat params
        if pl.stage == 1:
            out["grads", dev] += part.numel * pl.itemsize  # the full local gradients
        if pl.fp32 and pl.optimizer != "nvme" and pl.state_on_device:
            out["optimizer", dev] += 2 * shard * 4  # master = this rank's range of the params
            return out
    return out + _master_copy_bytes(shard, pl)


def _master_copy_bytes(shard: int, pl: _Placement) -> Counter:
    """A separate fp32 master with its moments and, at stage 3, the param shard."""
    out: Counter = Counter()
    state_tier = pl.memory(pl.optimizer)
    param_tier = pl.memory(pl.param)
    param_is_master = False
    if pl.stage == 3:
        if pl.param == "nvme":  # its own swap file, or the master's
            out["params", "nvme"] += 0 if pl.param_reads_master else aligned_size(shard * pl.itemsize)
        elif not pl.fp32 or pl.optimizer == "nvme" or not pl.param_with_state:
            out["params", param_tier] += shard * pl.itemsize
        else:
            param_is_master = True
    if pl.optimizer == "nvme":
        out["optimizer", "nvme"] += 3 * aligned_size(shard * 4)
    elif param_is_master:  # the fp32 param shard is the master itself
        out["params", state_tier] += shard * 4
        out["optimizer", state_tier] += 2 * shard * 4
    else:
        out["optimizer", state_tier] += 3 * shard * 4
    return out


def estimate(cfg: Config, world_size: int, *, rank: int = 0, device: str = "cuda",
             base_dtype: str | None = None) -> Estimate:
    """Per-rank bytes of ``cfg`` trained on ``world_size`` ranks (``rank``'s share), on a
    ``device`` of kind 'cuda' or 'cpu' (precision ``auto`` resolves by it). Frozen params
    (``train.freeze``, the base under ``peft``) count as weights only, in the compute dtype on
    the tier of their ZeRO stage and ``offload_param`` (``Estimate.frozen``); ``base_dtype``
    (the base checkpoint's, e.g. a bf16 import's) sizes the base on disk. Allocates nothing
    the size of the model."""
    zero, ep = cfg.zero_optimization, cfg.moe.ep_size
    dtype = cfg.precision.resolve(cuda=device == "cuda", bf16_supported=device == "cuda")
    topology = Topology(rank, world_size, (ep,))
    model = config_decoder(cfg, where="meta", ep_rank=topology.ep_rank(ep))
    planned = plan_model(model, cfg, world_size=world_size)
    specs, plan = planned.specs, planned.groups
    frozen = {g.name for g in plan if g.frozen}
    parts = [p for p in planned.partitions if rank in p.ranks]
    trained = [p for p in parts if p.group not in frozen]
    pl = _Placement(zero.stage, ITEMSIZE[dtype], device == "cpu", zero.offload_optimizer.device,
                    zero.offload_param.device, param_reads_master=not frozen and
                    params_read_master(zero, fp32=dtype == "fp32"))
    total: Counter = Counter()
    frozen_total: Counter = Counter()
    for part in parts:
        if part.group in frozen:
            frozen_total += _frozen_bytes(part, pl)
        else:
            total += _group_bytes(part, pl)
    in_place = _reads_in_place(cfg, base_dtype)
    if in_place:  # the base's own files (offload.base_params), in its dtype: no swap file
        frozen_total = Counter({("params", "nvme"): ITEMSIZE[base_dtype] * sum(
            _real(p, rank) for p in parts if p.group in frozen)})
    else:
        total += frozen_total
    units = _units(model, plan, parts, pl.itemsize) if zero.stage == 3 else {}
    unit, unit_bytes = max(((n, b) for n, b in units.items()), key=lambda nb: nb[1],
                           default=("", 0))
    activations = activation_bytes(cfg, pl.itemsize)
    largest = max((s.numel for s in specs if not s.frozen), default=0)
    shape = _step_shape(plan, trained, pl, units, largest)
    return Estimate(world_size, rank, zero.stage, dtype, device,
                    sum(s.numel for s in specs), sum(p.numel for p in trained),
                    tuple((c, t, b) for (c, t), b in sorted(total.items()) if b),
                    unit, unit_bytes, activations, transients(cfg, shape, activations),
                    RUNTIME_BYTES.get(device), sum(s.numel for s in specs if not s.frozen),
                    tuple((t, b) for (_, t), b in sorted(frozen_total.items()) if b), base_dtype,
                    in_place)


def _reads_in_place(cfg: Config, base_dtype: str | None) -> bool:
    """A LoRA run from a known base at stage 3 with params on NVMe reads its frozen params
    from the base checkpoint's files (``moezero.train.frozen_base``)."""
    zero = cfg.zero_optimization
    return base_dtype is not None and cfg.peft.uses_lora and zero.stage == 3 \
        and zero.offload_param.device == "nvme"


def _real(part: Partition, rank: int) -> int:
    """Real (unpadded) elements of ``rank``'s shard of ``part``."""
    lo, hi = part.rank_range(part.dp_rank(rank))
    return max(0, min(hi, part.numel) - min(lo, part.numel))


def _step_shape(plan, parts: list[Partition], pl: _Placement, units: dict[str, int],
                largest_param: int) -> StepShape:
    """What ``moezero.transients`` needs of this rank's groups and placement."""
    groups = {g.name: g for g in plan}
    kinds = tuple("dense" if not groups[p.group].is_expert
                  else f"moe/{groups[p.group].moe_group}/ep{p.ep_rank}" for p in parts)
    root = sum(b for n, b in units.items() if n.startswith("<root>"))
    blocks = max((b for n, b in units.items() if not n.startswith("<root>")), default=0)
    state = "cpu" if pl.host or pl.optimizer != "none" else "device"
    straddle = blocks // pl.itemsize if pl.stage == 3 else largest_param
    return StepShape(tuple(parts), kinds, pl.stage, pl.itemsize, pl.memory("none"), pl.host, state,
                     pl.optimizer == "nvme", (blocks, root), straddle)


def _units(model, plan, parts: list[Partition], itemsize: int) -> dict[str, int]:
    """Bytes of params of every stage-3 gather unit, gathered, by ``plan_units``."""
    groups = {g.name: g for g in plan}
    members = [[m.fqn for m in groups[p.group].members] for p in parts]
    units = plan_units([n for n, _ in unit_modules(model)],
                       {fqn: param_kind(p) for fqn, p in model.named_parameters()}, members,
                       own_units(model))
    return {u.name: sum(parts[i].numel for i in u.slots) * itemsize for u in units}


def format_table(est: Estimate) -> str:
    """The estimate as a text table (bytes in GiB) for the CLI."""
    gib = lambda b: f"{b / 2**30:10.3f}"
    lines = [f"moezero estimate: rank {est.rank} of {est.world_size}, ZeRO stage {est.stage}, "
             f"{est.dtype} on {est.device}; model {est.model_numel:,} params{_trained(est)}, "
             f"this rank's trained groups {est.local_numel:,}",
             f"{'GiB':<12}" + "".join(f"{t:>10}" for t in TIERS)]
    for c in CATEGORIES:
        lines.append(f"{c:<12}" + "".join(gib(est.get(c, t)) for t in TIERS))
    lines.append(f"{'total':<12}" + "".join(gib(est.tier_total(t)) for t in TIERS))
    if est.stage == 3:
        lines.append(f"largest gather unit: {est.gather_unit} {gib(est.gather_unit_bytes).strip()} "
                     f"GiB (two are live with prefetch)")
    lines += _frozen_lines(est, gib)
    lines.append(f"activations (one micro-batch): "
                 f"{gib(est.activation_bytes).strip()} GiB on the compute device")
    return "\n".join(lines + _peak_lines(est, gib))


def _frozen_lines(est: Estimate, gib) -> list[str]:
    """The frozen base: this rank's weights by tier, the base checkpoint on disk."""
    if not est.frozen_numel:
        return []
    held = ", ".join(f"{gib(b).strip()} GiB on {t}" for t, b in est.frozen)
    dtype = est.base_dtype or "bf16, assumed"
    how = (f"reads {held} in place from the base's files ({dtype}, no swap file)"
           if est.in_place else f"holds {held or 'none'} ({est.dtype})")
    return [f"frozen base: {est.frozen_numel:,} params; this rank {how}; the base checkpoint "
            f"{gib(est.base_disk_bytes()).strip()} GiB on disk ({dtype})"]


def _trained(est: Estimate) -> str:
    """`` (N trained)`` when some params are frozen."""
    n = est.trained_numel
    return "" if n is None or n == est.model_numel else f" ({n:,} trained)"


def _peak_lines(est: Estimate, gib) -> list[str]:
    """The predicted peak of each memory tier and its parts."""
    lines = []
    tiers = ("cpu",) if est.device == "cpu" else ("device", "cpu")
    for tier in tiers:
        phase = est.peak_phase(tier)
        name = "host (RSS)" if tier == "cpu" else "device"
        lines.append(f"peak {name}: {gib(est.peak(tier)).strip()} GiB = persistent "
                     f"{gib(est.tier_total(tier)).strip()} + {phase} transients "
                     f"{gib(est.phase_total(phase, tier)).strip()}" +
                     (f" + runtime {gib(est.runtime_bytes).strip()}" if tier == "cpu" and
                      est.runtime_bytes else ""))
        lines += [f"  {phase}: {t.what} {gib(t.bytes).strip()}" for t in est.transients
                  if t.phase == phase and t.tier == tier]
    if est.device == "cuda":
        lines.append("not counted: the CUDA context and allocator caching on the device, the "
                     "process runtime on the host (not measured without a GPU)")
    return lines
