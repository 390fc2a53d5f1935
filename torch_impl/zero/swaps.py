"""The NVMe swap files an optimizer owns: the fp32 state's, the stage-3 param shards' and the
reduced gradients' (``offload.state.SwapState`` objects, built by the engine's
``swap_factory``, so ``zero`` never imports ``offload``). ``Swaps`` holds the three tiers,
reports their traffic and removes them at a clean exit; the optimizer, its state
(``zero.states``), its frozen weights (``zero.frozen``) and its gradient tier
(``zero.gradtier``) each receive the tier they use. Reference counterpart: none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Swaps", "build_swaps"]

TIERS = ("optim", "param", "grad")


@dataclass(frozen=True)
class Swaps:
    """The swap files of each tier, or None where it is in memory.

    Attributes:
        optim: The fp32 state (master, exp_avg, exp_avg_sq) of the trained groups.
        param: Stage 3: the compute-dtype param shards (trained and frozen groups).
        grad: Stage 3 with the optimizer on NVMe: the reduced gradients (``zero.gradtier``).
    """

    optim: Any = None
    param: Any = None
    grad: Any = None

    def traffic(self) -> dict[str, int]:
        """Bytes read from / written to this rank's swap files so far and seconds blocked on
        them, by tier (``optim_``, ``param_``, ``grad_`` + ``read``/``write``/``wait_s``)."""
        return {f"{tier}_{op}": swap.traffic[op] if swap is not None else 0
                for tier, swap in zip(TIERS, (self.optim, self.param, self.grad), strict=True)
                for op in ("read", "write", "wait_s")}

    def close(self) -> None:
        """Close every tier's files and remove them (a clean exit)."""
        for swap in (self.optim, self.param, self.grad):
            if swap is not None:
                swap.close(remove=True)


def build_swaps(factory: Callable[..., tuple] | None, slots: Sequence, meter,
                frozen: Sequence = ()) -> Swaps:
    """The tiers ``factory(slots, meter)`` builds (``frozen``, the frozen groups' slots, are
    passed only when there are any: they get param files only); none without a factory."""
    if factory is None:
        return Swaps()
    if frozen:
        return Swaps(*factory(slots, meter, frozen=frozen))
    return Swaps(*factory(slots, meter))
