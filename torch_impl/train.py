"""The training loop of one rank: model, engine, data, metrics, checkpoints, plot and summary.

Runs inside an initialised process group (or alone with W = 1); the launcher decides how the
ranks are started. Rank 0 writes the run directory: ``config.yaml``, ``param_groups.json``,
``metrics.jsonl`` (one object per optimizer step, with the validation loss every
``train.eval_every`` steps and the telemetry of ``moezero.telemetry``), ``loss.png`` and
``tensorboard/`` (when installed); every rank writes its part of the checkpoints under
``checkpoint.dir`` (default ``<run dir>/checkpoints``): every ``checkpoint.every`` steps and at
the end. ``checkpoint.load`` resumes at the saved step with the saved data position (global
samples for prepared data), so the run continues the same token stream at any W. With
``checkpoint.load``, the architecture and tokenizer keys the user did not set
(``moezero.checkpoint.adopt``) are taken from the checkpoint's manifest, so
``--set checkpoint.load=DIR`` alone fine-tunes an imported Hugging Face model (docs/hf.md); an
architecture key set to another value is refused unless ``checkpoint.allow_arch_change`` lists
it.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from moezero.checkpoint import adapter_ckpt
from moezero.checkpoint.core import CheckpointError, check_shapes, model_shapes, resolve_load
from moezero.checkpoint.schedule import SaveClock, agree_step
from moezero.config import Config, ConfigError, dump_config
from moezero.data import DataError
from moezero.data.build import DataStream, build_batches
from moezero.distributed.devices import cuda_device_count, rank_device, resolve_backend
from moezero.distributed.failures import rank_errors
from moezero.distributed.heartbeat import WatchOptions
from moezero.distributed.launcher import launch
from moezero.distributed.signals import Preempted, PreemptOptions, StopRequest
from moezero.distributed.topology import Topology, build_topology
from moezero.engine import Engine, initialize
from moezero.model.args import model_args
from moezero.model.build import config_decoder, config_init
from moezero.model.decoder import Decoder
from moezero.model.materialize import KeyedInit
from moezero.model.packing import Batch
from moezero.offload.aio import OffloadIOError
from moezero.offload.options import IOOptions
from moezero.plan import store
from moezero.report import (
    draw_expert_load,
    format_summary,
    log_line,
    param_groups_table,
    plot_loss,
    print_group_table,
    summarize,
)
from moezero.rundir import agree_run_dir, checkpoint_bytes
from moezero.telemetry import LoadWatch, StepTelemetry
from moezero.validation import evaluate
from moezero.zero.groups import PlanMismatchError

EXPECTED_ERRORS = (CheckpointError, ConfigError, DataError, OffloadIOError, OSError,
                   PlanMismatchError)
"""What a rank reports as one line (docs/reliability.md); anything else is a crash."""

METRIC_KEYS = ("step", "loss", "ce", "aux_loss", "lr", "grad_norm", "loss_scale", "skipped",
               "tokens_per_s", "trained_tokens_per_s", "step_time_s", "peak_mem_bytes", "step_peak_engine_bytes", "mfu",
               "moe_imbalance_max", "moe_dropped_frac", "moe", "swap_read_bytes",
               "swap_write_bytes", "swap_param_read_bytes", "swap_param_write_bytes", "phases")
"""Keys of every ``metrics.jsonl`` row; ``val_loss`` and ``val_ppl`` join them on evaluation
steps. ``tokens_per_s`` counts this rank's targets (seen), ``trained_tokens_per_s`` those a
loss mask trains (docs/data.md). ``peak_mem_bytes`` is the peak of that step alone; ``mfu`` is None where the device's
peak is unknown; ``moe`` lists every MoE layer's load (moezero.telemetry); ``swap_*`` are the
step's bytes between rank 0 and its NVMe swap files (0 without NVMe offload); ``phases``
splits the step's time (and its swap bytes and waits) by phase (``moezero.phases``)."""
EVAL_KEYS = ("val_loss", "val_ppl")


def build_model(cfg: Config, topology: Topology) -> Decoder:
    """The decoder with this rank's experts (and the ``peft`` adapters) on the CPU,
    initialised identically for any W and ep."""
    ep = cfg.moe.ep_size
    return config_decoder(cfg, where="cpu", ep_rank=topology.ep_rank(ep),
                          ep_group=topology.ep_group(ep))


def sharded_model(cfg: Config, topology: Topology) -> tuple[Decoder, KeyedInit]:
    """The decoder on the meta device and its FQN-keyed init, for the engine to materialise
    only what this rank keeps (sharded construction, docs/scale.md); the same values as
    ``build_model``."""
    ep = cfg.moe.ep_size
    model = config_decoder(cfg, where="meta", ep_rank=topology.ep_rank(ep),
                           ep_group=topology.ep_group(ep))
    return model, config_init(cfg)


def setup(cfg: Config, device: torch.device, io: IOOptions | None = None,
          base: Path | None = None) -> tuple[Engine, DataStream]:
    """Topology, model, engine (with ``io``; ``base``: ``frozen_base``) and this rank's data
    stream (collective: every rank calls it)."""
    topology = build_topology([cfg.moe.ep_size], num_experts=cfg.moe.num_experts)
    torch.manual_seed(cfg.train.seed)
    model, init = sharded_model(cfg, topology)
    engine = initialize(model, cfg, topology=topology, device=device, io=io, init=init,
                        base=base)
    batches = build_batches(cfg, dp_rank=topology.rank, dp_size=topology.world_size)
    return engine, batches


def frozen_base(cfg: Config, root: Path) -> Path | None:
    """The base step directory a LoRA run at stage 3 with ``offload_param.device: nvme`` reads
    its frozen params from in place (docs/finetune.md), else None."""
    zero = cfg.zero_optimization
    if not (cfg.peft.uses_lora and cfg.checkpoint.load and zero.stage == 3
            and zero.offload_param.device == "nvme"):
        return None
    return adapter_ckpt.frozen_source(resolve_load(cfg.checkpoint.load, root))


def preflight(cfg: Config, run_dir: str | Path) -> Path | None:
    """Checks that need no process group, for the CLI to report in one line before any rank
    starts: the checkpoint ``checkpoint.load`` names exists, is complete and fits the model.

    Returns:
        The step directory to resume from, or None.

    Raises:
        CheckpointError: one line starting ``checkpoint.load:``.
    """
    if not cfg.checkpoint.load:
        return None
    ckpt = resolve_load(cfg.checkpoint.load, cfg.checkpoint.resolve_dir(run_dir))
    shapes = model_shapes(config_decoder(cfg, where="meta", adapters=False))  # the base's
    try:
        manifest, where = store.read_manifest(ckpt), ckpt
        if manifest.base:  # adapters (LoRA): the model's weights are in the base checkpoint
            where = adapter_ckpt.check(manifest.base, ckpt)
            manifest = store.read_manifest(where)
        check_shapes(manifest, shapes, where)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint.load: {exc}") from None
    if cfg.peft.uses_lora:
        _check_base_outside(where, cfg.checkpoint.resolve_dir(run_dir))
    return ckpt


def _check_base_outside(base: Path, root: Path) -> None:
    """A LoRA run's base checkpoint must not lie in the checkpoint root the run saves into:
    the run counts steps from 0 there, and its saves and ``keep_last`` would replace the base
    (docs/finetune.md). One-line CheckpointError naming both."""
    if Path(base).resolve().is_relative_to(Path(root).resolve()):
        raise CheckpointError(f"checkpoint.dir: {root} holds {base}, the base of this LoRA run: "
                              "its saves and keep_last would replace it; give the LoRA run its "
                              "own --out (or checkpoint.dir)")


def model_numel(cfg: Config, *, adapters: bool = False) -> int:
    """Elements of the global model (every expert once; the LoRA adapters too with
    ``adapters``), from shapes on the meta device."""
    shapes = model_shapes(config_decoder(cfg, where="meta", adapters=adapters))
    return sum(math.prod(shape) for shape in shapes.values())


def checkpoint_size(cfg: Config) -> int:
    """Bytes of one checkpoint of the model (``rundir.checkpoint_bytes``), from shapes on the
    meta device."""
    shapes = model_shapes(config_decoder(cfg, where="meta", adapters=False))
    return checkpoint_bytes(sum(math.prod(s) for s in shapes.values()), len(shapes))


def resume(cfg: Config, engine: Engine, batches: DataStream, root: Path) -> Path | None:
    """Load ``checkpoint.load`` (collective) into the engine and the data stream."""
    if not cfg.checkpoint.load:
        return None
    ckpt = resolve_load(cfg.checkpoint.load, root)
    state = engine.load_checkpoint(ckpt).get("data")
    if state is not None and batches.accepts(state):
        batches.load_state_dict(state)
    elif state is not None and engine.topology.rank == 0:
        print("moezero: the checkpoint's data position is of another kind of data; this data "
              "starts from its beginning", flush=True)
    return ckpt


def train(cfg: Config, run_dir: str | Path, device: torch.device | None = None,
          io: IOOptions | None = None, stop: StopRequest | None = None) -> dict:
    """Train ``cfg.train.steps`` steps; returns the summary (rank 0's is the one printed).

    ``stop``: when any rank's request is set (a preemption signal), every rank finishes its
    step, saves and raises ``Preempted`` (docs/reliability.md)."""
    run_dir = Path(run_dir)
    device = device or torch.device("cpu")
    root = cfg.checkpoint.resolve_dir(run_dir)
    engine, batches = setup(cfg, device, io, base=frozen_base(cfg, root))
    try:
        resumed = resume(cfg, engine, batches, root)
    except BaseException:
        engine.close()  # a failed start: its swap files and folders are removed
        raise
    lead = engine.topology.rank == 0
    if lead:
        _start_run_dir(cfg, engine, batches, run_dir, resumed)
    tele = StepTelemetry(engine, model_args(cfg), cfg.train.seq_len,
                         run_dir / "tensorboard" if lead else None,
                         LoadWatch(cfg.telemetry.dead_expert_steps, cfg.telemetry.max_imbalance))
    try:
        history = _loop(cfg, engine, batches, run_dir if lead else None, root, tele,
                        saved=engine.global_steps if resumed is not None else None, stop=stop)
        if lead:  # beside loss.png; the TensorBoard image before its writer closes
            draw_expert_load(history, run_dir / "expert_load.png", tele.tensorboard)
    except Preempted as done:
        engine.close()
        if lead:
            why = f" ({stop.reason})" if stop is not None else ""
            print(f"moezero: preempted after step {done.step}{why}: checkpoint "
                  f"{done.checkpoint}; resume with --set checkpoint.load=latest", flush=True)
        raise
    finally:
        tele.close()
    engine.close()  # a clean exit: swap files are removed
    summary = summarize(history, batches.corpus)
    if lead:
        plot_loss(history, summary, run_dir / "loss.png")
        print(format_summary(summary, run_dir), flush=True)
        latest = store.find_latest(root)
        if latest is not None:
            print(f"checkpoint: {latest}", flush=True)
    return summary


def _start_run_dir(cfg: Config, engine: Engine, batches: DataStream, run_dir: Path,
                   resumed: Path | None) -> None:
    """Rank 0: the run directory's config and group table, and the run's opening lines."""
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
    (run_dir / "param_groups.json").write_text(
        json.dumps(param_groups_table(engine.groups), indent=1))
    print(f"moezero: W={engine.topology.world_size} ep={cfg.moe.ep_size} "
          f"stage={cfg.zero_optimization.stage} dtype={str(engine.dtype).removeprefix('torch.')} "
          f"data: {batches.corpus.describe()}", flush=True)
    print_group_table(engine.groups)
    if resumed is not None and store.read_manifest(resumed).layout.weights_only:
        print(f"moezero: starting from base {resumed} (its weights; a new optimizer at step 0)",
              flush=True)
    elif resumed is not None:
        print(f"moezero: resumed from {resumed} at step {engine.global_steps}", flush=True)


def _loop(cfg: Config, engine: Engine, batches: DataStream, run_dir: Path | None, root: Path,
          tele: StepTelemetry, *, saved: int | None, stop: StopRequest | None = None) -> list[dict]:
    """Train from ``engine.global_steps`` to ``train.steps``; evaluate every
    ``train.eval_every`` steps and at the end; save every ``checkpoint.every`` steps, when
    ``checkpoint.every_minutes`` have passed (rank 0's clock) and at the end (unless step
    ``saved`` is already on disk); on an agreed preemption request, save and raise
    ``Preempted``; a failed async save stops every rank after the step that found it
    (``checkpoint.schedule.agree_step``)."""
    every, start, steps = cfg.checkpoint.every, engine.global_steps, cfg.train.steps
    clock = SaveClock(cfg.checkpoint.every_minutes)
    history = _previous_metrics(run_dir, start) if run_dir else []
    # A bar on a terminal; in logs (no tty) one line every ``train.log_every`` steps instead.
    log_lines = run_dir is not None and not sys.stderr.isatty()
    tqdm.set_lock(threading.RLock())  # not its multiprocessing lock: a killed rank leaks that
    bar = tqdm(total=steps, initial=start, disable=run_dir is None or log_lines,
               dynamic_ncols=True, mininterval=1.0, desc="train")
    metrics_file = open(run_dir / "metrics.jsonl", "a") if run_dir else None
    try:
        for step in range(start + 1, steps + 1):
            history.append(row := _step(cfg, engine, batches, tele, step))
            if metrics_file:
                metrics_file.write(json.dumps({k: row[k] for k in METRIC_KEYS + EVAL_KEYS
                                               if k in row}) + "\n")
                metrics_file.flush()
                tele.tensorboard.write(row)
                for line in row["warnings"]:
                    print(line, flush=True) if log_lines else bar.write(line)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.3f}", ce=f"{row['ce']:.3f}",
                                lr=f"{row['lr']:.1e}", refresh=False)
            if log_lines and (step % cfg.train.log_every == 0 or step == steps or "val_loss" in row):
                print(log_line(history, steps, cfg.train.log_every), flush=True)
            if every and step % every == 0 and step < steps:
                saved = _save(engine, batches, root, clock)
            agreed = agree_step(stop=stop, clock=clock, save_failed=engine.checkpointer.failed,
                                rank=engine.topology.rank, device=engine.device)
            if agreed.save_failed:
                _raise_failed_save(engine, step)
            if agreed.save and saved != engine.global_steps and step < steps:
                saved = _save(engine, batches, root, clock)
            if agreed.stop:
                _preempt(engine, batches, root, saved)
        if saved != engine.global_steps:
            _save(engine, batches, root)
        engine.wait_checkpoint()
    finally:
        bar.close()
        if metrics_file:
            metrics_file.close()
    return history


def _step(cfg: Config, engine: Engine, batches: DataStream, tele: StepTelemetry,
          step: int) -> dict:
    """One optimizer step's metrics row (and the validation loss when one is due)."""
    tele.begin_step()
    micro = [Batch.of(batches.next_batch()) for _ in range(cfg.train.grad_accum_steps)]
    row = tele.end_step({"step": step, **engine.train_step(micro)})
    every = cfg.train.eval_every
    if every and (step % every == 0 or step == cfg.train.steps):
        row.update(evaluate(engine, batches, cfg.train.eval_batches, tele.load))
    return row


def _preempt(engine: Engine, batches: DataStream, root: Path, saved: int | None) -> None:
    """Save this step (unless it is saved), wait for the save, raise ``Preempted``."""
    if saved != engine.global_steps:
        _save(engine, batches, root)
    engine.wait_checkpoint()
    raise Preempted(engine.global_steps, root / store.step_dir_name(engine.global_steps))


def _save(engine: Engine, batches: DataStream, root: Path, clock: SaveClock | None = None) -> int:
    engine.save_checkpoint(root, state={"data": batches.state_dict()})
    if clock is not None:
        clock.saved()
    return engine.global_steps


def _raise_failed_save(engine: Engine, step: int) -> None:
    """Raise the error of the async save that failed (every rank has it: the save agreed on
    it), saying when it was found."""
    try:
        engine.wait_checkpoint()
    except CheckpointError as exc:
        raise CheckpointError(f"{exc} (an async save; found after step {step})") from None


def _previous_metrics(run_dir: Path, start: int) -> list[dict]:
    """Rows of ``metrics.jsonl`` up to step ``start`` (a resumed run's history); the file is
    rewritten with just those, so rows of steps about to be redone disappear."""
    path = run_dir / "metrics.jsonl"
    rows = []
    if start and path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut short by a crash
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= start:
                rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def launch_training(cfg: Config, run_dir: Path, nproc: int,
                    io: IOOptions | None = None) -> int:
    """Train with ``nproc`` local ranks (or join the torchrun world); returns an exit code.
    ``io``: the engines' I/O options (a test's ``save_writer`` injects save faults)."""
    backend = resolve_backend(cfg.dist.backend, cuda_device_count())
    return launch(_train_rank, (cfg.model_dump(by_alias=True), str(run_dir), io),
                  nproc=nproc,
                  backend=backend, timeout_s=cfg.dist.timeout_s,
                  preempt=PreemptOptions.from_names(cfg.train.preempt_signals),
                  watch=WatchOptions(cfg.dist.heartbeat_s, run_dir / "logs"))


def _train_rank(cfg_data: dict, run_dir: str, io: IOOptions | None = None, *,
                stop: StopRequest | None = None) -> None:
    """One rank of ``moezero train``: rank 0's run directory on every rank (each torchrun
    worker's CLI picked its own), expected errors as one line (``EXPECTED_ERRORS``)."""
    cfg = Config.model_validate(cfg_data)
    device = rank_device(resolve_backend(cfg.dist.backend, cuda_device_count()))
    rank = dist.get_rank() if dist.is_initialized() else 0
    run_dir, lock = agree_run_dir(run_dir, rank=rank, device=device,
                                  ckpt_root=cfg.checkpoint.resolve_dir(run_dir))
    try:
        with rank_errors(rank, run_dir / "logs", EXPECTED_ERRORS):
            train(cfg, run_dir, device, io, stop)
    finally:
        if lock is not None:
            lock.release()
