"""One rank of the ``bigbase`` series' peer: TRL ``SFTTrainer`` + PEFT LoRA + DeepSpeed ZeRO-3
with ``offload_param`` on NVMe and the optimizer on the host.

Runs in the peer venv (``torchrun --nproc_per_node 2 -m benchmarks.bigbase_peer SPEC.json
RESULT.json``, ``DS_ACCELERATOR=cpu``), like the ``finetune`` series' peer
(``benchmarks.finetune_peer``: its trainer, step clock and records), on the same bf16 HF folder
and conversations as moezero's row, the same sequence length, LoRA r/alpha on attention and the
fused experts, ``steps`` steps. The model is loaded and run in bf16, the folder's dtype: its
fp32 copy would need 62 GB of swap, more than this box's disk. The swap folder is the spec's
``nvme_path``. Per step: wall time and the process's bytes read (``/proc/self/io``); peak RSS and
anonymous memory per rank. The host side (``benchmarks.bigbase_watch``) bounds it in time and
disk and records the resources when it stops it.
"""

from __future__ import annotations

import sys

from benchmarks.common import AnonPeak, anon_rss
from benchmarks.finetune_peer import ATTENTION, EXPERTS, _clock, _trainer_class, _versions, vm_hwm
from benchmarks.finetune_peer import main as peer_main


def deepspeed_config(spec: dict) -> dict:
    """ZeRO-3, params swapped to ``nvme_path``, the optimizer's state on the host; the swap
    buffers hold the largest param's partition (``buffer_size``: DeepSpeed refuses a smaller
    one: its default 1e8 for the 16 B model's embedding, 155.6 M elements a rank, or its
    fused experts' gate-and-up tensor, 201.3 M)."""
    return {"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "offload_param": {"device": "nvme", "nvme_path": spec["nvme_path"],
                          "pin_memory": False, "buffer_count": 5,
                          "buffer_size": max(1e8, spec.get("largest_partition", 0))},
        "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 1e8, "stage3_max_reuse_distance": 1e8},
        "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False,
                "overlap_events": True, "thread_count": 1},
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}


def _config(spec: dict):
    from trl import SFTConfig

    return SFTConfig(
        output_dir=spec["ckpt_dir"], use_cpu=True, bf16=True, fp16=False,
        deepspeed=deepspeed_config(spec), per_device_train_batch_size=1,
        gradient_accumulation_steps=1, max_steps=spec["steps"], learning_rate=1e-4,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        max_length=spec["seq_len"], packing=True, assistant_only_loss=True, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True)


def _build(spec: dict):
    import deepspeed
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    deepspeed.init_distributed(dist_backend="gloo")
    args = _config(spec)  # first: its DeepSpeed config makes from_pretrained partition
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.bfloat16)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=ATTENTION,
                      target_parameters=EXPERTS, task_type="CAUSAL_LM")
    data = load_dataset("json", data_files=spec["chats"], split="train")
    clock = _clock()
    trainer = _trainer_class()(model=model, args=args, train_dataset=data, processing_class=tok,
                               peft_config=lora, callbacks=[clock])
    return trainer, clock


def run_rank(spec: dict) -> dict:
    anon_start, sampler = anon_rss(), AnonPeak()
    try:
        trainer, clock = _build(spec)
        trainer.train()
    finally:
        anon_peak = sampler.stop()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return {"step_s": clock.step_s, "losses": losses, "seen": trainer.seen,
            "anon_start": anon_start, "anon_peak": anon_peak, "peak_rss": vm_hwm(),
            "versions": _versions()}


def main(argv: list[str] | None = None) -> int:
    return peer_main(argv, run_rank)


if __name__ == "__main__":
    sys.exit(main())
