"""DeepSpeed's training settings -> moezero config sections (docs/migrate-deepspeed.md).

Read from the checkpoint itself: ``ds_config`` (recorded in every model-states file) and the
optimizer's ``param_groups`` (lr, betas, eps, weight decay as the run last used them), and
DeepSpeed's warmup lr schedules as ``optimizer.scheduler`` (their peak as ``optimizer.lr``, not
the lr of the last step). What has no moezero counterpart is returned as a note.
"""

from __future__ import annotations

from moezero.plan.store import CheckpointError

_NORM_OR_BIAS = ("norm", "bias")


def optimizer_section(ds_config: dict, param_groups: list[dict], group_names: list[list[str]],
                      where: str) -> tuple[dict, list[str]]:
    """moezero's ``optimizer`` section and the notes of what did not carry over."""
    notes = []
    opt = ds_config.get("optimizer") or {}
    kind = str(opt.get("type", "?")).lower()
    if kind not in ("adam", "adamw"):
        raise CheckpointError(f"{where}: optimizer type {opt.get('type')!r}: only Adam/AdamW "
                              "state can be imported")
    if kind == "adam" and not (opt.get("params") or {}).get("adam_w_mode", True):
        raise CheckpointError(f"{where}: Adam with adam_w_mode=false (L2 in the gradient) has "
                              "no moezero counterpart (decoupled weight decay)")
    first = param_groups[0] if param_groups else {}
    decays = [float(g.get("weight_decay", 0.0)) for g in param_groups] or [0.0]
    section = {"lr": float(first.get("lr", (opt.get("params") or {}).get("lr", 1e-3))),
               "betas": [float(b) for b in first.get("betas", (0.9, 0.999))],
               "eps": float(first.get("eps", 1e-8)), "weight_decay": max(decays),
               "no_decay_on_norms": _no_decay_on_norms(decays, group_names, where),
               "gradient_clipping": float(ds_config.get("gradient_clipping", 0.0)) or None}
    section.update(_schedule(ds_config.get("scheduler"), (opt.get("params") or {}).get("lr"),
                             notes))
    if len({float(g.get("lr", 0.0)) for g in param_groups}) > 1:
        notes.append("param groups with different lr: the first group's lr is used")
    return section, notes


def _no_decay_on_norms(decays: list[float], names: list[list[str]], where: str) -> bool:
    """One decay everywhere -> False; the transformers Trainer's split (no decay on norms and
    biases) -> True; anything else is refused."""
    if len(set(decays)) == 1:
        return False
    undecayed = [n for d, group in zip(decays, names, strict=True) if d == 0 for n in group]
    if set(decays) - {0.0} and len(set(decays) - {0.0}) == 1 and all(
            any(k in n for k in _NORM_OR_BIAS) for n in undecayed):
        return True
    raise CheckpointError(f"{where}: param groups with weight decays {sorted(set(decays))}: "
                          "moezero has one decay, off only on norms and biases")


_SCHEDULE_KEYS = {"WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                 "warmup_type"),
                  "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps",
                                     "cos_min_ratio", "warmup_type")}
_SCHEDULE_KEYS["WarmupDecayLR"] = (*_SCHEDULE_KEYS["WarmupLR"], "total_num_steps")


def _schedule(scheduler: dict | None, opt_lr: float | None, notes: list[str]) -> dict:
    """A constant lr (no scheduler) maps exactly; DeepSpeed's warmup schedules map to
    ``optimizer.scheduler`` (peak: ``warmup_max_lr``, or the optimizer's lr, as ``lr``);
    anything else is noted, naming what was not carried over (the lr stays the last one)."""
    if not scheduler:
        return {"warmup_steps": 0, "min_lr_ratio": 1.0}
    kind, params = scheduler.get("type"), scheduler.get("params") or {}
    keys = _SCHEDULE_KEYS.get(kind)
    unknown = sorted(set(params) - set(keys or ())) if keys else []
    peak = params.get("warmup_max_lr", opt_lr) if kind != "WarmupCosineLR" else opt_lr
    bad = [k for k in keys or () if k in params and not isinstance(params[k], int | float | str)]
    if keys is None or unknown or bad or not isinstance(peak, int | float):
        why = (f"its parameter {(unknown or bad)[0]!r}" if unknown or bad else
               "no peak lr (warmup_max_lr or the optimizer's lr)" if keys else
               "no moezero counterpart")
        notes.append(f"lr scheduler {kind!r}: not carried over ({why}); optimizer.lr is the lr "
                     "of its last step, constant (set optimizer.scheduler or warmup_steps "
                     "yourself)")
        return {"warmup_steps": 0, "min_lr_ratio": 1.0}
    mapped = {k: params[k] for k in keys if k in params and k != "warmup_max_lr"}
    return {"lr": float(peak), "warmup_steps": 0, "min_lr_ratio": 1.0,
            "scheduler": {"type": kind, **mapped}}


def precision_section(ds_config: dict) -> dict:
    """fp16/bf16 when DeepSpeed trained in them, else fp32."""
    for key, dtype in (("bf16", "bf16"), ("fp16", "fp16")):
        if (ds_config.get(key) or {}).get("enabled"):
            return {"dtype": dtype}
    return {"dtype": "fp32"}


def zero_section(ds_config: dict, stage: int) -> dict:
    """DeepSpeed's ZeRO stage and its optimizer/param offload (device and NVMe path)."""
    zero = ds_config.get("zero_optimization") or {}
    out = {"stage": stage}
    for key, applies in (("offload_optimizer", stage >= 1), ("offload_param", stage == 3)):
        block = zero.get(key) or {}
        device = block.get("device", "none")
        if applies and device in ("cpu", "nvme"):
            out[key] = {"device": device}
            if device == "nvme" and block.get("nvme_path"):
                out[key]["nvme_path"] = str(block["nvme_path"])
    return out


def train_section(ds_config: dict) -> dict:
    """Micro-batch size and accumulation, where DeepSpeed's config gives numbers."""
    out = {}
    for ds_key, key in (("train_micro_batch_size_per_gpu", "micro_batch_size"),
                        ("gradient_accumulation_steps", "grad_accum_steps")):
        if isinstance(ds_config.get(ds_key), int):
            out[key] = ds_config[ds_key]
    return out
