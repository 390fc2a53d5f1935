"""The config's schema: one pydantic model per section, validated on load and on assignment.

Sections mirror DeepSpeed's names where the concept is the same (``zero_optimization.stage``,
``offload_optimizer.device``, ``nvme_path``, ``gradient_clipping``, the fp16 loss-scale knobs).
Each field has a default and a description; unknown keys are refused. ``Config()`` is the
embedded default recipe. Cross-field rules raise
``FieldError`` naming the field; the rules shared with the reference (the ``ep`` check, the
expert group's default name) are the plan's (``moezero.plan.rules``). The model's sections,
``model`` and ``moe``, with the architecture keys, are ``moezero.config.model``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from moezero.config.errors import FieldError
from moezero.config.model import ARCHITECTURE_KEYS, ModelConfig, MoEConfig
from moezero.config.offload import OptimizerOffloadConfig, ParamOffloadConfig
from moezero.config.peft import PeftConfig, attention_target_problem
from moezero.config.schedule import LRScheduleConfig
from moezero.config.section import Section as _Section


class TrainConfig(_Section):
    """The training loop."""

    steps: int = Field(300, ge=1, description="Optimizer steps to run (total, including resumed ones).")
    seed: int = Field(0, ge=0, description="Seed for parameter init, routing noise and data order.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per rank per micro-batch.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches averaged per optimizer step.")
    seq_len: int = Field(128, ge=1, description="Tokens per sequence.")
    log_every: int = Field(10, ge=1, description="Print progress every this many steps.")
    eval_every: int = Field(
        50, ge=0, description="Validation loss every this many steps and at the end; 0 = never.")
    eval_batches: int = Field(
        4, ge=1, description="Global validation batches per evaluation (micro_batch_size per rank).")
    out_dir: str | None = Field(None, description="Run directory; None lets the CLI pick one (--out sets it).")
    deterministic: bool = Field(
        False, description="CUDA: deterministic kernels (torch.use_deterministic_algorithms, "
                           "cuDNN, cuBLAS workspace); slower. No effect on CPU (docs/model.md).")
    freeze: list[str] = Field(
        [], description="FQN glob patterns of parameters never trained, in order; '!' unfreezes "
                        "(['*', '!*.experts.*'] trains the experts only). Frozen parameters get "
                        "no gradient and no optimizer state (docs/finetune.md).")
    preempt_signals: list[Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGXCPU"]] = Field(
        ["SIGTERM", "SIGUSR1"],
        description="Signals that make every rank finish its step, save and exit (code 75); "
                    "a second one aborts at once. [] = off (default actions).")




class PrecisionConfig(_Section):
    """Compute dtype and fp16 dynamic loss scaling (DeepSpeed's ``fp16`` block)."""

    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Compute dtype; auto = bf16 on GPUs that support it, else fp32.")
    initial_scale_power: int = Field(16, ge=0, le=64, description="fp16: initial loss scale is 2**this.")
    loss_scale_window: int = Field(1000, ge=1, description="fp16: overflow-free steps before doubling.")
    hysteresis: int = Field(2, ge=1, description="fp16: overflows tolerated before halving the scale.")
    min_loss_scale: float = Field(1.0, gt=0, description="fp16: the scale never drops below this.")

    def resolve(self, *, cuda: bool, bf16_supported: bool) -> Literal["fp32", "bf16", "fp16"]:
        """The concrete dtype for a device (``auto`` never reaches the engine)."""
        if self.dtype != "auto":
            return self.dtype
        return "bf16" if cuda and bf16_supported else "fp32"

    @model_validator(mode="after")
    def _scale(self) -> PrecisionConfig:
        if self.min_loss_scale > 2.0**self.initial_scale_power:
            raise FieldError("min_loss_scale", f"must be <= 2**initial_scale_power, got {self.min_loss_scale}")
        return self


class OptimizerConfig(_Section):
    """AdamW with linear warmup then cosine decay."""

    type: Literal["adamw"] = Field("adamw", description="Optimizer; only AdamW for now.")
    lr: float = Field(3e-3, ge=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam (beta1, beta2), each in [0, 1).")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay.")
    no_decay_on_norms: bool = Field(True, description="No weight decay on norm gains and biases.")
    expert_lr: float | None = Field(None, ge=0, description="Peak lr of expert params; None = lr.")
    router_lr: float | None = Field(None, ge=0, description="Peak lr of router params; None = lr.")
    gradient_clipping: float | None = Field(
        1.0, ge=0, description="Clip the global grad norm to this; 0 or None disables.")
    warmup_steps: int = Field(30, ge=0, description="Linear warmup steps from 0 to lr.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay ends at lr * this.")
    scheduler: LRScheduleConfig | None = Field(
        None, description="A DeepSpeed lr schedule (WarmupLR, WarmupDecayLR, WarmupCosineLR) "
                          "in place of warmup_steps/min_lr_ratio; import-deepspeed sets it.")

    @property
    def max_grad_norm(self) -> float | None:
        """``gradient_clipping`` with 0 normalised to None (no clipping)."""
        return self.gradient_clipping or None

    @model_validator(mode="after")
    def _betas(self) -> OptimizerConfig:
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise FieldError(f"betas.{i}", f"must be in [0, 1), got {beta}")
        return self


class ZeroConfig(_Section):
    """ZeRO sharding (DeepSpeed's ``zero_optimization`` block)."""

    stage: int = Field(2, ge=0, le=3, description="0 = plain DP, 1 = shard optimizer state, "
                                                  "2 = + gradients, 3 = + parameters.")
    tiled_step: bool = Field(True, description="Step one optimizer group at a time (bounded fp32 peak).")
    reduce_bucket_size: int = Field(int(5e7), ge=1, description="Elements per gradient-reduction bucket.")
    overlap_comm: bool = Field(True, description="Overlap gradient reduction with backward.")
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype gradients are reduce-scattered / all-reduced in (upcast to "
                            "fp32 for the step); bf16 halves the bytes sent.")
    allgather_bucket_size: int | None = Field(
        int(5e7), ge=1, description="Elements per parameter all-gather bucket (stages 1-3); "
                                    "null = one all-gather per optimizer group.")
    prefetch_max_bytes: int | None = Field(
        None, ge=0, description="Stage 3: a gather unit is gathered ahead (while the one "
                                "before it runs) only if its params take at most this many "
                                "bytes, so two big units (a MoE layer's experts) are never "
                                "gathered at once; null = always, 0 = never.")
    offload_optimizer: OptimizerOffloadConfig = Field(
        default_factory=OptimizerOffloadConfig, description="Optimizer state offload (stage >= 1).")
    offload_param: ParamOffloadConfig = Field(
        default_factory=ParamOffloadConfig, description="Parameter offload (stage 3 only).")

    @model_validator(mode="after")
    def _offload(self) -> ZeroConfig:
        if self.offload_optimizer.device != "none" and self.stage < 1:
            raise FieldError("offload_optimizer.device",
                              f"offloading the optimizer needs zero_optimization.stage >= 1, got {self.stage}")
        if self.offload_param.device != "none" and self.stage != 3:
            raise FieldError("offload_param.device",
                              f"offloading params needs zero_optimization.stage 3, got {self.stage}")
        self._nvme_budgets()
        return self

    @property
    def steps_in_forward(self) -> bool:
        """``offload_optimizer.step_in_forward`` resolved: null means on wherever it applies
        (stage 3 with the optimizer and the params on nvme)."""
        chosen = self.offload_optimizer.step_in_forward
        return self._nvme_state_and_params if chosen is None else chosen

    @property
    def _nvme_state_and_params(self) -> bool:
        """Where ``step_in_forward`` applies: stage 3, optimizer and params on nvme."""
        return self.stage == 3 and self.offload_optimizer.device == "nvme" \
            and self.offload_param.device == "nvme"

    def _nvme_budgets(self) -> None:
        """The stage-3/NVMe byte budgets, refused where they would do nothing."""
        nvme_state = self.offload_optimizer.device == "nvme"
        rules = (("offload_param.keep_for_backward", self.offload_param.keep_for_backward,
                  self.stage == 3, "keeps stage-3 gather units: needs zero_optimization.stage 3"),
                 ("offload_optimizer.keep_grads", self.offload_optimizer.keep_grads,
                  self.stage == 3 and nvme_state, "keeps gradients out of their swap files: "
                  "needs zero_optimization.stage 3 with offload_optimizer.device nvme"),
                 ("offload_optimizer.read_in_backward", self.offload_optimizer.read_in_backward,
                  nvme_state, "reads swapped optimizer state early: needs "
                  "offload_optimizer.device nvme"),
                 ("offload_optimizer.step_in_forward", self.offload_optimizer.step_in_forward,
                  self._nvme_state_and_params,
                  "steps behind the next forward's gathers: needs zero_optimization.stage 3 "
                  "with offload_optimizer.device and offload_param.device nvme"))
        for key, value, applies, why in rules:
            if value and not applies:
                raise FieldError(key, f"{why} (stage {self.stage}, offload_optimizer.device "
                                      f"{self.offload_optimizer.device})")


class CheckpointConfig(_Section):
    """Saving and resuming."""

    model_config = ConfigDict(populate_by_name=True)

    every: int = Field(0, ge=0, description="Save every this many steps; 0 = only at the end.")
    every_minutes: float = Field(
        30, ge=0, description="Also save once this many minutes have passed since the last save "
                              "(rank 0's clock, agreed by every rank); 0 = off.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints to keep; older ones are deleted.")
    load: str | None = Field(None, min_length=1, description="Resume from a step directory, or 'latest'.")
    async_save: bool = Field(False, alias="async", description="Write in the background (key: async).")
    verify_on_load: bool = Field(
        True, description="Check every range's crc32 while it is read and every file's header "
                          "against the manifest; a mismatch stops the run before it starts.")
    dir: str | None = Field(None, description="Checkpoint root; None = <run dir>/checkpoints.")
    allow_arch_change: list[Literal[ARCHITECTURE_KEYS]] = Field(  # type: ignore[valid-type]
        [], description="Architecture keys (e.g. moe.top_k, moe.capacity_factor) a resume may "
                        "set to another value than the checkpoint's; other changes are refused.")

    def resolve_dir(self, run_dir: str | os.PathLike) -> Path:
        """The checkpoint root for a run directory."""
        return Path(self.dir) if self.dir else Path(run_dir) / "checkpoints"


class DataConfig(_Section):
    """Training data: prepared token datasets, a byte-level text file, or the synthetic corpus."""

    path: str | list[str] | None = Field(
        None, description="Prepared dataset folder(s) (moezero prepare-data), blended; or one "
                          "text file read as bytes; None = synthetic corpus.")
    weights: list[float] | None = Field(
        None, description="Blend weights of the datasets in path (normalised); None = by their "
                          "training tokens.")
    val_fraction: float = Field(
        0.01, ge=0, lt=1, description="Held out for validation: this fraction of each prepared "
                                      "dataset's documents (of a text file's bytes, its tail).")
    document_mask: bool | None = Field(
        None, description="Packed documents attend only within themselves, rotary positions "
                          "restarting per document; None = on for chat and prompt-completion "
                          "datasets, off otherwise (docs/data.md).")
    synthetic_vocab: int = Field(32, ge=2, description="Synthetic corpus: token alphabet size.")
    synthetic_sources: int = Field(4, ge=1, description="Synthetic corpus: seeded Markov sources mixed.")
    synthetic_seed: int = Field(1234, ge=0, description="Synthetic corpus: seed of the sources.")

    @property
    def paths(self) -> list[str]:
        """``path`` as a list (empty for the synthetic corpus)."""
        return [] if self.path is None else [self.path] if isinstance(self.path, str) else self.path

    @model_validator(mode="after")
    def _blend(self) -> DataConfig:
        if isinstance(self.path, list) and not self.path:
            raise FieldError("path", "an empty list; give at least one dataset or null")
        if self.weights is not None:
            if len(self.weights) != len(self.paths):
                raise FieldError("weights", f"{len(self.weights)} weights for "
                                             f"{len(self.paths)} data.path entries")
            if any(not w > 0 for w in self.weights):
                raise FieldError("weights", f"must all be > 0, got {self.weights}")
        return self


class TokenizerConfig(_Section):
    """The model's tokenizer (recorded by import-hf or taken from a prepared dataset), so
    checkpoints carry it, datasets are matched to it and export writes it back."""

    path: str | None = Field(None, description="Folder holding tokenizer.json and its "
                                               "Hugging Face companion files.")
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$",
                               description="SHA-256 of tokenizer.json; datasets must match it.")
    vocab_size: int | None = Field(None, ge=1, description="Tokens in its vocabulary.")
    bos_token_id: int | None = Field(None, ge=0, description="Beginning-of-sequence id.")
    eos_token_id: int | None = Field(None, ge=0, description="End-of-sequence id.")
    pad_token_id: int | None = Field(None, ge=0, description="Padding id.")


class HfConfig(_Section):
    """What import-hf recorded for the export beside the architecture (docs/hf.md,
    "Qwen3.5-MoE"): the Hugging Face family, and the tensors it carried through untrained."""

    model_type: str | None = Field(None, description="The model_type that export --format hf "
                                                     "writes; None: the architecture's family.")
    carried: str | None = Field(None, description="Folder of the source's config.json and the "
                                                  "tensors moezero does not train "
                                                  "(carried.safetensors: a vision tower), "
                                                  "written back unchanged by export.")
    carried_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$",
                                       description="SHA-256 of carried.safetensors.")


class DistConfig(_Section):
    """torch.distributed."""

    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto = nccl on CUDA, else gloo.")
    timeout_s: float = Field(300.0, gt=0, description="Collective timeout in seconds.")
    heartbeat_s: float = Field(30.0, ge=1, description="A spawned rank silent this long is "
                               "named as hung and the job is stopped (docs/reliability.md); "
                               "at least 1 s (ranks beat every heartbeat_s / 6).")


class TelemetryConfig(_Section):
    """Warnings about the router's expert load in the progress output (docs/data.md)."""

    dead_expert_steps: int = Field(
        50, ge=0, description="Warn, once per MoE layer, when an expert receives no tokens for "
                              "this many consecutive steps or the layer's imbalance stays above "
                              "max_imbalance as long; 0 = never.")
    max_imbalance: float = Field(
        3.0, gt=1, description="Imbalance (max / mean tokens per expert) above which a layer "
                               "counts as unbalanced (E / top_k is all tokens on top_k experts).")


class ActivationCheckpointingConfig(_Section):
    """Recompute decoder blocks in backward instead of keeping their activations."""

    enabled: bool = Field(False, description="Checkpoint decoder blocks (torch.utils.checkpoint).")
    every_n_layers: int = Field(1, ge=1, description="Checkpoint blocks 0, n, 2n, ...; 1 = every block.")


class Config(_Section):
    """A whole run. ``Config()`` is the embedded default recipe."""

    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Decoder architecture.")
    moe: MoEConfig = Field(default_factory=MoEConfig, description="MoE layers.")
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig, description="Mixed precision.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer + schedule.")
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO sharding/offload.")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig, description="Recompute blocks in backward.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training data.")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer.")
    hf: HfConfig = Field(default_factory=HfConfig, description="Hugging Face export.")
    dist: DistConfig = Field(default_factory=DistConfig, description="torch.distributed.")
    peft: PeftConfig = Field(default_factory=PeftConfig, description="LoRA fine-tuning.")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig,
                                       description="Expert-load warnings.")

    def check_peft_targets(self) -> None:
        """FieldError when ``peft.targets`` names the shared expert or the dense MLP of a
        model without one. With ``checkpoint.load`` the model is the checkpoint's:
        ``checkpoint.adopt`` checks after adopting its architecture."""
        if self.peft.uses_lora and not self.moe.shared_ffn_dim \
                and any(t.startswith("shared") for t in self.peft.targets):
            raise FieldError("peft.targets", "names the shared expert, but the model has none "
                                             "(moe.shared_ffn_dim is 0)")
        if self.peft.uses_lora and not self.model.first_k_dense \
                and any(t.startswith("mlp") for t in self.peft.targets):
            raise FieldError("peft.targets", "names the dense MLP, but the model has none "
                                             "(model.first_k_dense is 0)")
        problem = attention_target_problem(self.peft.targets, self.model.attention,
                                           self.model.q_lora_rank)
        if self.peft.uses_lora and problem:
            raise FieldError("peft.targets", problem)
        if self.peft.uses_lora and not self.model.gated_delta_layers \
                and any(t.startswith("linear_attn") for t in self.peft.targets):
            raise FieldError("peft.targets", "names gated DeltaNet, but the model has none "
                                             "(model.gated_delta_layers is empty)")

    @model_validator(mode="after")
    def _across_sections(self) -> Config:
        if self.data.path is None and self.data.synthetic_vocab > self.model.vocab_size:
            raise FieldError("data.synthetic_vocab",
                              f"must be <= model.vocab_size ({self.model.vocab_size}), "
                              f"got {self.data.synthetic_vocab}")
        if not self.checkpoint.load:  # else after adopting its architecture (checkpoint.adopt)
            self.check_peft_targets()
        if (self.tokenizer.vocab_size or 0) > self.model.vocab_size:
            raise FieldError("tokenizer.vocab_size",
                             f"must be <= model.vocab_size ({self.model.vocab_size}), "
                             f"got {self.tokenizer.vocab_size}")
        return self
