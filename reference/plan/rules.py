"""The rules both sides need, each written once: expert names, the expert group's default
name, the optimizer's state names, the ``ep`` divisibility check and the weight-decay rule.

Pure Python (no numpy, torch or jax), so the torch side (``moezero.model.specs``,
``moezero.model.moe``, ``moezero.config``, ``moezero.distributed.topology``) and the JAX
reference (``moezero.reference.optim``, ``.weights``, ``.zero_layout``, ``.sharded``) call the
same functions and agree by construction.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

EXPERTS = "experts"
"""The module name under which a MoE layer holds its experts (``<layer>.experts.<e>.…``)."""

MASTER = "master"
MOMENTS = ("exp_avg", "exp_avg_sq")
STATES = (MASTER, *MOMENTS)
"""The fp32 optimizer state of every element: the master weight and AdamW's two moments."""

_EXPERT_FQN = re.compile(rf"^(?P<layer>.+)\.{EXPERTS}\.(?P<expert>\d+)\.(?P<rest>.+)$")


class ExpertName(NamedTuple):
    """An expert parameter's FQN in parts: ``{layer}.experts.{expert}.{rest}``."""

    layer: str  # the MoE layer's FQN, e.g. ``layers.3.moe``
    expert: int  # the global expert index
    rest: str  # the parameter inside the expert, e.g. ``w1.weight``

    @property
    def fqn(self) -> str:
        return expert_fqn(self.layer, self.expert, self.rest)


def parse_expert_fqn(fqn: str) -> ExpertName | None:
    """The parts of an expert parameter's FQN; ``None`` for a name with no ``.experts.<i>.``
    (the last such segment counts, e.g. ``a.experts.1.b.experts.2.w`` is expert 2 of
    ``a.experts.1.b``)."""
    match = _EXPERT_FQN.match(fqn)
    if match is None:
        return None
    return ExpertName(match["layer"], int(match["expert"]), match["rest"])


def expert_fqn(layer: str, expert: int, rest: str) -> str:
    """``layers.3.moe.experts.5.w1.weight`` for (``layers.3.moe``, 5, ``w1.weight``); with
    ``layer=""`` (the params of one MoE layer on their own) ``experts.5.w1.weight``."""
    return ".".join(part for part in (layer, EXPERTS, str(expert), rest) if part)


def expert_group_name(name: str | None, *, ep_size: int) -> str:
    """The expert group's name (``moe.expert_group_name``): ``name``, or ``ep_size_{ep}``."""
    return name or f"ep_size_{ep_size}"


def ep_size_problem(ep_size: int, *, world_size: int | None = None,
                    num_experts: int | None = None) -> str | None:
    """What is wrong with an expert-parallel size, or ``None``: ``ep_size`` must be >= 1 and
    divide the world size and the expert count (each checked when given).

    The message has no subject (``"3 does not divide world_size 4"``): callers prefix the
    key they report (``ep_size``, ``moe.ep_size``).
    """
    if ep_size < 1:
        return f"must be >= 1, got {ep_size}"
    if world_size is not None and world_size % ep_size:
        return f"{ep_size} does not divide world_size {world_size}"
    if num_experts is not None and num_experts % ep_size:
        return f"{ep_size} does not divide num_experts {num_experts}"
    return None


def check_ep_size(*, ep_size: int, world_size: int | None = None,
                  num_experts: int | None = None) -> None:
    """Raise ValueError (one line, ``ep_size …``) on an ``ep_size_problem`` (or a world size
    below 1)."""
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    problem = ep_size_problem(ep_size, world_size=world_size, num_experts=num_experts)
    if problem is not None:
        raise ValueError(f"ep_size {problem}")


def group_problem(*, num_experts: int, top_k: int, n_group: int,
                  topk_group: int) -> tuple[str, str] | None:
    """What is wrong with a group-limited routing (``moe.n_group``, ``moe.topk_group``), or
    ``None``: ``(key, message)``. The groups split the experts evenly, at least two each (a
    group scores by its two best experts), ``topk_group`` of them (at most ``n_group``) hold
    at least ``top_k`` experts. One group (the default) routes over every expert."""
    if n_group > 1 and (num_experts % n_group or num_experts // n_group < 2):
        return "n_group", (f"must split the {num_experts} experts into groups of at least 2, "
                           f"got {n_group}")
    if topk_group > n_group:
        return "topk_group", f"must be <= n_group ({n_group}), got {topk_group}"
    if topk_group * (num_experts // n_group) < top_k and n_group > 1:
        return "topk_group", (f"its {topk_group} groups of {num_experts // n_group} experts hold "
                              f"fewer than top_k={top_k}")
    return None


def weight_decay_applies(fqn: str, shape: Sequence[int]) -> bool:
    """Whether AdamW's decoupled weight decay applies to parameter ``fqn`` of ``shape``.

    Matrices decay (embeddings, projections, the router, every expert's weights); norm gains
    (``*norm.weight``, whatever their shape), biases, vectors and scalars (``ndim < 2``) do
    not. ``shape`` is the parameter's own shape: one expert's, never a stack of experts.
    """
    return len(shape) >= 2 and not fqn.endswith("norm.weight")
