"""Which parameters ``train.freeze`` freezes: FQN glob patterns, applied in order.

A pattern is an ``fnmatch`` glob over the fully qualified name (``*`` also crosses dots:
``layers.*.moe.router.*``); a pattern starting with ``!`` unfreezes what it matches, so
``["*", "!*.experts.*"]`` freezes everything but the routed experts. The last pattern that
matches a parameter decides. Each pattern must match at least one parameter (a typo would
otherwise silently train everything), and at least one parameter must stay trained.

Both sides call ``frozen_fqns`` on the global FQNs (every expert by global index): the torch
side in ``moezero.zero.groups.build_groups``, the reference in ``moezero.reference.optim``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

LORA_PARAMS = ("*.lora_A", "*.lora_B")
"""FQN patterns of LoRA adapters (``<projection>.lora_A`` [r, in], ``.lora_B`` [out, r])."""


def freeze_patterns(patterns: Sequence[str], *, lora: bool) -> list[str]:
    """The patterns in force: with LoRA, everything but the adapters is frozen first
    (``["*", "!*.lora_A", "!*.lora_B"]``), then ``patterns`` apply (``!`` unfreezes more)."""
    base = ["*", *(f"!{p}" for p in LORA_PARAMS)] if lora else []
    return [*base, *patterns]


def frozen_fqns(patterns: Sequence[str], fqns: Iterable[str]) -> frozenset[str]:
    """The FQNs among ``fqns`` that ``patterns`` freeze.

    Raises:
        ValueError: (one line) naming the first pattern that matches nothing, or when
            every parameter would be frozen.
    """
    fqns = list(fqns)
    frozen: set[str] = set()
    for pattern in patterns:
        negate, glob = pattern.startswith("!"), pattern.removeprefix("!")
        hits = {f for f in fqns if fnmatchcase(f, glob)}
        if not glob or not hits:
            raise ValueError(f"pattern {pattern!r} matches no parameter")
        frozen = frozen - hits if negate else frozen | hits
    if fqns and frozen == set(fqns):
        raise ValueError(f"patterns {list(patterns)} freeze every parameter: nothing to train")
    _check_adapters(patterns, [f for f in fqns if f in frozen])
    return frozenset(frozen)


def _check_adapters(patterns: Sequence[str], frozen: list[str]) -> None:
    """ValueError naming the pattern that freezes a LoRA adapter (the first of ``frozen``,
    in model order; only LoRA runs have them):
    a LoRA run trains its adapters, and a frozen one would be read from the base, which has
    none."""
    adapters = [f for f in frozen if any(fnmatchcase(f, p) for p in LORA_PARAMS)]
    if adapters:
        pattern = next(p for p in reversed(patterns)
                       if not p.startswith("!") and fnmatchcase(adapters[0], p))
        raise ValueError(f"pattern {pattern!r} freezes the LoRA adapter {adapters[0]}: a LoRA "
                         "run trains its adapters (leave them out of train.freeze)")
