"""Plain records the plan is computed from and made of: user groups, parameter specs, slices.

Everything here is pure data (frozen, hashable, printable, comparable) keyed by the
parameter's fully qualified name (FQN), so both sides can build the same plan from the
same specs. Torch counterpart: ``moezero.model.specs`` builds ``ParamSpec``s from an
``nn.Module`` and ``moezero.zero.groups`` consumes the plan; both import this module rather
than copying it.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_DIGITS = re.compile(r"([0-9]+)")


def natural_key(text: str) -> tuple:
    """Sort key that orders digit runs by value, so ``layers.10`` sorts after ``layers.2``.

    The raw text is the last element, which makes the order total (``x01`` vs ``x1``).
    """
    # split() with a capture group alternates text, digits, text, ...: odd positions are digits.
    parts = tuple(int(p) if i % 2 else p for i, p in enumerate(_DIGITS.split(text)))
    return (parts, text)


def _check_name(value: str, what: str, fqn: str) -> None:
    """Reject names that are empty or contain '/', which would make group names ambiguous."""
    if not isinstance(value, str) or not value or "/" in value:
        raise ValueError(f"param {fqn!r}: {what} must be a non-empty string without '/', got {value!r}")


@dataclass(frozen=True)
class UserGroup:
    """A user's hyperparameter group, e.g. ``UserGroup("decay", {"weight_decay": 0.1})``.

    ``hparams`` may be given as a mapping or as pairs; it is stored as sorted pairs so the
    record stays hashable and two equal groups compare equal whatever the input order.
    """

    name: str
    hparams: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"user group name must be a non-empty string without '/', got {self.name!r}")
        items = self.hparams.items() if isinstance(self.hparams, Mapping) else self.hparams
        pairs = tuple(sorted((str(k), v) for k, v in items))
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"user group {self.name!r}: duplicate hyperparameter in {keys}")
        object.__setattr__(self, "hparams", pairs)

    def as_dict(self) -> dict[str, float]:
        """The hyperparameters as a fresh dict, e.g. to build a torch/optax param group."""
        return dict(self.hparams)


@dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know about one parameter.

    Attributes:
        fqn: Fully qualified name, experts by *global* index
            (``layers.3.moe.experts.5.w1.weight``).
        shape: The full (unsharded) shape; ``()`` is a scalar of one element.
        dtype: Storage dtype name; recorded, not used to group (masters are fp32).
        user_group: Name of the ``UserGroup`` giving its hyperparameters.
        moe_group: The expert group name (``expert_group_name``, e.g. ``ep_size_2``) for
            expert params; ``None`` for dense params.
        ep_size: Expert-parallel size of that moe group (1 for dense params).
        layer: FQN of the MoE layer the expert belongs to (``layers.3.moe``).
        expert: Global expert index inside that layer.
        frozen: Never trained (``train.freeze``): in a frozen group of the plan, which is
            partitioned and checkpointed (weights only) but never stepped.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    user_group: str = "default"
    moe_group: str | None = None
    ep_size: int = 1
    layer: str | None = None
    expert: int | None = None
    frozen: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.fqn, str) or not self.fqn:
            raise ValueError(f"param fqn must be a non-empty string, got {self.fqn!r}")
        try:  # accept any integer type (numpy, torch.Size) but store plain ints
            shape = tuple(operator.index(d) for d in self.shape if not isinstance(d, bool))
        except TypeError:
            shape = None
        if shape is None or len(shape) != len(tuple(self.shape)) or min(shape, default=0) < 0:
            raise ValueError(f"param {self.fqn!r}: shape must be non-negative ints, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        _check_name(self.user_group, "user_group", self.fqn)
        if self.moe_group is None:
            self._check_dense()
        else:
            self._check_expert()

    def _check_dense(self) -> None:
        for field, value, default in (("layer", self.layer, None), ("expert", self.expert, None),
                                      ("ep_size", self.ep_size, 1)):
            if value != default:
                raise ValueError(f"param {self.fqn!r}: dense param (moe_group=None) sets {field}={value!r}")

    def _check_expert(self) -> None:
        _check_name(self.moe_group, "moe_group", self.fqn)
        if self.layer is None:
            raise ValueError(f"param {self.fqn!r}: expert param is missing layer")
        _check_name(self.layer, "layer", self.fqn)
        if self.expert is None:
            raise ValueError(f"param {self.fqn!r}: expert param is missing expert")
        if not _is_int(self.expert) or self.expert < 0:
            raise ValueError(f"param {self.fqn!r}: expert must be an int >= 0, got {self.expert!r}")
        if not _is_int(self.ep_size) or self.ep_size < 1:
            raise ValueError(f"param {self.fqn!r}: ep_size must be an int >= 1, got {self.ep_size!r}")

    @property
    def numel(self) -> int:
        """Number of elements (1 for a scalar)."""
        return math.prod(self.shape)

    @property
    def is_expert(self) -> bool:
        """True for expert params (those with a moe group)."""
        return self.moe_group is not None


@dataclass(frozen=True, order=True)
class Slice:
    """The element range ``[start, stop)`` of a flattened parameter; never empty."""

    fqn: str
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not (_is_int(self.start) and _is_int(self.stop) and 0 <= self.start < self.stop):
            raise ValueError(f"slice of {self.fqn!r}: need 0 <= start < stop, got [{self.start}, {self.stop})")

    @property
    def numel(self) -> int:
        """Number of elements in the range."""
        return self.stop - self.start


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def user_groups_by_name(groups: Iterable[UserGroup]) -> dict[str, UserGroup]:
    """Index user groups by name, rejecting duplicates (one line, naming the group)."""
    out: dict[str, UserGroup] = {}
    for group in groups:
        if group.name in out:
            raise ValueError(f"user group {group.name!r} is defined twice")
        out[group.name] = group
    return out
