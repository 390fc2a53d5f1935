"""DeepSpeed's training settings -> moezero config sections (docs/migrate-deepspeed.md).

Read from the checkpoint itself: ``ds_config`` (recorded in every model-states file) and the
optimizer's ``param_groups`` (lr, betas, eps, weight decay as the run last used them). What
has no moezero counterpart is returned as a note, and left at moezero's default.
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
    section.update(_schedule(ds_config.get("scheduler"), notes))
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


def _schedule(scheduler: dict | None, notes: list[str]) -> dict:
    """A constant lr (no scheduler) maps exactly; other schedules are noted."""
    if not scheduler:
        return {"warmup_steps": 0, "min_lr_ratio": 1.0}
    notes.append(f"lr scheduler {scheduler.get('type')!r}: no exact moezero counterpart; "
                 "optimizer.warmup_steps/min_lr_ratio left at moezero's defaults")
    return {}


def precision_section(ds_config: dict) -> dict:
    """fp16/bf16 when DeepSpeed trained in them, else fp32."""
    for key, dtype in (("bf16", "bf16"), ("fp16", "fp16")):
        if (ds_config.get(key) or {}).get("enabled"):
            return {"dtype": dtype}
    return {"dtype": "fp32"}


def train_section(ds_config: dict) -> dict:
    """Micro-batch size and accumulation, where DeepSpeed's config gives numbers."""
    out = {}
    for ds_key, key in (("train_micro_batch_size_per_gpu", "micro_batch_size"),
                        ("gradient_accumulation_steps", "grad_accum_steps")):
        if isinstance(ds_config.get(ds_key), int):
            out[key] = ds_config[ds_key]
    return out
