"""LoRA adapters (``peft.method: lora``): ``y = W x + b + alpha/r · B A dropout(x)``.

``apply_lora`` turns the targeted ``nn.Linear`` projections of a built decoder (attention's
``wq``/``wk``/``wv``/``wo``, the shared expert's, the dense MLP's and every routed expert's
``w1``/``w3``/``w2``: each module names its owner and projections, ``lora_owner`` and
``lora_projections``) into ``LoRALinear``: the same module with two more parameters, ``lora_A`` [r, in] and
``lora_B`` [out, r], so the FQNs sit next to the base weight (``layers.0.attn.wq.lora_A``,
``layers.0.moe.experts.5.w1.lora_B``). A routed expert's adapters are its own parameters,
tagged like its weights (``ExpertTag``: same moe group, global index), so they live on the
expert's EP rank and are grouped per layer and expert like any expert parameter; the grouped
path runs every local expert's adapters with the same grouped GEMM as the experts
(``grouped_swiglu``, ``GroupedLinear``), never a loop over experts. ``lora_B`` starts at zero
(``decoder.init_weights``), so a fresh adapter leaves the model unchanged. The base weights
are frozen by the plan (``moezero.plan.freeze.freeze_patterns``).

Reference counterpart: ``reference/model.py: linear`` and ``reference/moe.py:
apply_experts`` with ``ModelConfig.lora_*``. Legend: N rows, I input dim, O output dim,
R rank, L local experts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moezero.model.experts import SwiGLU
from moezero.model.moe import MoE, SameExperts


@dataclass(frozen=True)
class LoraOptions:
    """``peft`` with ``method: lora``: rank, alpha, dropout and the targeted projections
    (``attn``, ``shared``, ``experts``, ``mlp`` or one projection of them, e.g. ``attn.wq``)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("attn",)

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def wants(self, owner: str, proj: str) -> bool:
        """Whether projection ``proj`` of an ``owner`` (attn, shared, experts, mlp) gets
        adapters."""
        return owner in self.targets or f"{owner}.{proj}" in self.targets


def lora_options(peft) -> LoraOptions | None:
    """The ``LoraOptions`` of a config's ``peft`` section, or None without LoRA."""
    if not peft.uses_lora:
        return None
    return LoraOptions(peft.r, peft.alpha, peft.dropout, tuple(peft.targets))


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus ``scale · lora_B (lora_A dropout(x))``; made by ``add_adapter``."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scale: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + self.scale * delta


def add_adapter(linear: nn.Linear, options: LoraOptions) -> LoRALinear:
    """Make ``linear`` a ``LoRALinear`` in place (A and B on its device and dtype, uninitialised:
    ``init_weights`` fills them), copying an expert weight's tag to the adapters."""
    w = linear.weight
    linear.__class__ = LoRALinear
    linear.lora_A = nn.Parameter(torch.empty(options.r, w.shape[1], device=w.device, dtype=w.dtype))
    linear.lora_B = nn.Parameter(torch.empty(w.shape[0], options.r, device=w.device, dtype=w.dtype))
    linear.scale = options.scale
    linear.lora_dropout = nn.Dropout(options.dropout) if options.dropout else nn.Identity()
    tag = getattr(w, "moe", None)
    if tag is not None:
        linear.lora_A.moe = linear.lora_B.moe = tag
    return linear


def apply_lora(model: nn.Module, options: LoraOptions | None) -> nn.Module:
    """Adapters on the targeted projections of ``model`` (in place; None: nothing)."""
    if options is None:
        return model
    for name, module in list(model.named_modules()):
        owner, projs = _owner(name, module)
        for proj in projs if owner else ():
            if options.wants(owner, proj):
                add_adapter(getattr(module, proj), options)
        if isinstance(module, MoE):  # other EP ranks' experts are planned from the source
            module._expert_source = (_with_adapters(module._expert_source[0], options),)
    return model


def _with_adapters(source, options: LoraOptions):
    """An expert factory by global index that adds the adapters to ``source``'s experts; a
    ``SameExperts`` when ``source`` is one or a template module (its experts all alike)."""
    def build(e: int) -> nn.Module:
        module = copy.deepcopy(source) if isinstance(source, nn.Module) else source(e)
        for proj in SwiGLU.lora_projections if isinstance(module, SwiGLU) else ():
            if options.wants("experts", proj):
                add_adapter(getattr(module, proj), options)
        return module
    if isinstance(source, (nn.Module, SameExperts)):  # build ignores the index
        return SameExperts(lambda: build(0))
    return build


def _owner(name: str, module: nn.Module) -> tuple[str | None, tuple[str, ...]]:
    """A module's LoRA owner and projections, as its kind declares them (``lora_owner``,
    ``lora_projections``); a ``SwiGLU`` is the ``experts`` owner only inside ``experts``."""
    owner = getattr(module, "lora_owner", None)
    if owner is None or (owner == "experts") != (".experts." in f".{name}."):
        return None, ()
    return owner, module.lora_projections
