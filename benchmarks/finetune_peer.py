"""One rank of the ``finetune`` series' peer: TRL ``SFTTrainer`` + PEFT LoRA + DeepSpeed ZeRO-3.

Runs in the peer venv (``torchrun --nproc_per_node 2 -m benchmarks.finetune_peer SPEC.json
RESULT.json``, ``DS_ACCELERATOR=cpu``; the repository on ``sys.path`` for
``benchmarks.common``). The same HF model folder, conversations, chat template, sequence
length, micro-batch, lr and steps as moezero's rows: ``assistant_only_loss`` (the template's
``{% generation %}`` spans), BFD packing (padding-free: each micro-batch is one flattened row,
positions restarting per conversation, which transformers' masks turn into per-conversation
attention; with ``"packing": false`` in the spec one conversation per row, right-padded:
transformers' Qwen3-Next refuses packed rows on CPU, without the CUDA-only
``causal_conv1d``/``fla`` kernels), LoRA r/alpha on ``[q,k,v,o]_proj`` and the fused experts
(``target_parameters``), fp32, constant lr, AdamW (HF's, under DeepSpeed). Per timed step:
wall time from ``on_step_begin`` to ``on_step_end``, the batch's tokens and trained targets
(labels not -100 after the shift); peak anonymous memory sampled from the start; then one
checkpoint as ``save_strategy`` writes it, timed barrier to barrier. Rank 0 writes every
rank's record as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from benchmarks.common import AnonPeak, anon_rss, barrier_timed, tree_bytes

DEEPSPEED = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
             "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
             "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
             "fp16": {"enabled": "auto"}}
"""ZeRO-3, everything else from the trainer's arguments (HF refuses values that differ)."""
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _config(spec: dict):
    from trl import SFTConfig

    return SFTConfig(
        output_dir=spec["ckpt_dir"], use_cpu=True, bf16=False, fp16=False,
        deepspeed=DEEPSPEED, per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=1, max_steps=spec["warmup"] + spec["timed"],
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=1.0, max_length=spec["seq_len"], packing=spec.get("packing", True),
        assistant_only_loss=True, logging_steps=1, save_strategy="no", report_to=[],
        seed=spec["seed"], dataloader_num_workers=0, disable_tqdm=True)


def _trainer_class():
    from trl import SFTTrainer

    class CountingTrainer(SFTTrainer):
        """SFTTrainer counting each micro-batch's tokens and trained targets."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen: list[int] = []
            self.trained: list[int] = []

        def training_step(self, model, inputs, *args, **kwargs):
            self.seen.append(int(inputs["input_ids"].numel()))
            self.trained.append(int((inputs["labels"][..., 1:] != -100).sum()))
            return super().training_step(model, inputs, *args, **kwargs)

    return CountingTrainer


def _clock():
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Wall time of every optimizer step."""

        def __init__(self):
            self.step_s: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self._start)

    return StepClock()


def _build(spec: dict):
    """Trainer (model loaded under ZeRO-3's partitioned init), clock."""
    import deepspeed
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    deepspeed.init_distributed(dist_backend="gloo")  # before the config: it reads the world
    args = _config(spec)  # first: its DeepSpeed config makes from_pretrained partition
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    lora = LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=0.0,
                      target_modules=spec.get("target_modules", ATTENTION),
                      target_parameters=spec.get("target_parameters", EXPERTS),
                      task_type="CAUSAL_LM")
    data = load_dataset("json", data_files=spec["chats"], split="train")
    clock = _clock()
    trainer = _trainer_class()(model=model, args=args, train_dataset=data, processing_class=tok,
                               peft_config=lora, callbacks=[clock])
    return trainer, clock


def _dataset_counts(trainer) -> dict:
    """Tokens and trained tokens of the whole packed training set (TRL folds the assistant
    masks into ``labels``: -100 where not trained)."""
    data = trainer.train_dataset
    return {"tokens": sum(map(len, data["input_ids"])),
            "trained": sum(sum(x != -100 for x in row) for row in data["labels"]),
            "rows": len(data)}


def _save(trainer, folder: str) -> dict:
    """The checkpoint ``save_strategy`` writes (adapter, DeepSpeed's ZeRO-3 model and
    optimizer partitions, scheduler, RNG and trainer state), timed barrier to barrier."""
    seconds = barrier_timed(lambda _: trainer._save_checkpoint(trainer.model, trial=None), folder)
    step = next(p for p in Path(folder).iterdir() if p.name.startswith("checkpoint-"))
    size, files = tree_bytes(step)
    adapter = step / "adapter_model.safetensors"
    return {"save_s": seconds, "bytes": size, "files": files,
            "adapter_bytes": adapter.stat().st_size if adapter.exists() else None}


def run_rank(spec: dict) -> dict:
    anon_start, sampler = anon_rss(), AnonPeak()
    try:
        trainer, clock = _build(spec)
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        trainer.train()
    finally:
        anon_peak = sampler.stop()
    import torch

    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    warm = spec["warmup"]
    record = {"step_s": clock.step_s[warm:], "seen": trainer.seen[warm:],
              "trained": trainer.trained[warm:], "losses": losses, "anon_start": anon_start,
              "anon_peak": anon_peak, "peak_rss": vm_hwm(),
              "dataset": _dataset_counts(trainer), "trainable_numel": trainable,
              "versions": _versions(), "threads": torch.get_num_threads()}
    record["checkpoint"] = _save(trainer, spec["ckpt_dir"])
    return record


def vm_hwm() -> int:
    """Peak resident set size of this process (``VmHWM``), as ``benchmarks.common.peak_rss``
    reads it through moezero (not installed here)."""
    status = Path("/proc/self/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmHWM:"))) * 1024


def _versions() -> dict:
    import deepspeed
    import peft
    import torch
    import transformers
    import trl

    return {m.__name__: m.__version__ for m in (trl, peft, deepspeed, transformers, torch)}


def main(argv: list[str] | None = None, run=None) -> int:
    """A rank of the peer: ``argv`` = the spec's JSON path and the result's; ``run`` (default
    this module's ``run_rank``; the bigbase series passes its own) gives the rank's record;
    rank 0 writes every rank's."""
    spec_path, result_path = argv if argv is not None else sys.argv[1:]
    spec = json.loads(Path(spec_path).read_text())
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    record = (run or run_rank)(spec)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, record)
    if dist.get_rank() == 0:
        Path(result_path).write_text(json.dumps({"spec": spec, "ranks": ranks}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
