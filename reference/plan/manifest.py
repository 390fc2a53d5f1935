"""The manifest's pure half: ``manifest.json`` to and from a ``Manifest`` (layout recomputed
from its groups, shapes and buffers), and the check that checksummed ranges tile every file.

File I/O is ``moezero.plan.store``; the layout itself is ``moezero.plan.layout``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moezero.plan.grouping import GroupPlan
from moezero.plan.layout import FORMAT_VERSION, Layout, RangeRecord, plan_layout
from moezero.plan.specs import Slice, natural_key


def group_to_json(group: GroupPlan) -> dict:
    """A group as a JSON object (members as ``[fqn, start, stop]``; ``"frozen": true`` for a
    frozen group only, so manifests without frozen groups are unchanged)."""
    obj = {"name": group.name, "index": group.index, "user_group": group.user_group,
           "moe_group": group.moe_group, "ep_size": group.ep_size, "ep_rank": group.ep_rank,
           "layer": group.layer, "expert": group.expert,
           "members": [[m.fqn, m.start, m.stop] for m in group.members]}
    if group.frozen:
        obj["frozen"] = True
    return obj


def group_from_json(obj: Mapping) -> GroupPlan:
    """Inverse of ``group_to_json``."""
    members = tuple(Slice(fqn, start, stop) for fqn, start, stop in obj["members"])
    return GroupPlan(obj["name"], obj["index"], obj["user_group"], obj["moe_group"],
                     obj["ep_size"], obj["ep_rank"], obj["layer"], obj["expert"], members,
                     obj.get("frozen") is True)


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` holds, with the layout recomputed from its groups and shapes.

    ``config``, ``topology`` and ``state`` are opaque JSON objects owned by the caller
    (resolved config; world size, ep sizes, stage at save; RNG, data position, loss
    scaler, lr step). ``base`` (``{"path", "sha256"}``, else empty): a checkpoint of the
    trained params only, whose frozen params are those of the base checkpoint at ``path``
    whose ``manifest.json`` had that sha256 (LoRA, docs/checkpoint.md).
    """

    layout: Layout
    checksums: tuple[RangeRecord, ...]
    config: dict = field(default_factory=dict)
    topology: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    base: dict = field(default_factory=dict)

    @property
    def step(self) -> int:
        """The optimizer step saved."""
        return self.layout.step


def manifest_to_json(manifest: Manifest) -> dict:
    """The manifest as a JSON object (the layout as groups, shapes and file sizes)."""
    layout = manifest.layout
    obj = {"format": "moezero-checkpoint", "format_version": FORMAT_VERSION,
           "step": layout.step, "dtype": layout.dtype, "config": manifest.config,
           "topology": manifest.topology,
           "groups": [group_to_json(g) for g in layout.groups],
           "shapes": {fqn: list(shape) for fqn, shape in layout.shapes},
           "files": [{"name": f.name, "kind": f.kind, "group": f.group, "size": f.size}
                     for f in layout.files],
           "checksums": [list(r) for r in manifest.checksums], "state": manifest.state}
    if layout.weights_only:  # only then: older manifests stay byte-identical
        obj["weights_only"] = True
    if layout.buffers:  # likewise
        obj["buffers"] = {fqn: list(shape) for fqn, shape in layout.buffers}
    if manifest.base:  # likewise
        obj["base"] = manifest.base
    if layout.frozen:  # likewise; the groups say it too ("frozen": true)
        obj["frozen_params"] = sorted(layout.frozen, key=natural_key)
    return obj


def manifest_from_json(obj: Any) -> Manifest:
    """Parse and cross-check a manifest object; ValueError (one line) on any mismatch."""
    if not isinstance(obj, dict) or obj.get("format") != "moezero-checkpoint":
        raise ValueError("not a moezero checkpoint manifest")
    if obj.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"unsupported format_version {obj.get('format_version')!r} "
                         f"(this reader knows {FORMAT_VERSION})")
    try:
        layout = plan_layout([group_from_json(g) for g in obj["groups"]], obj["shapes"],
                             step=int(obj["step"]), weights_only=obj.get("weights_only") is True,
                             buffers=obj.get("buffers") or {}, dtype=obj.get("dtype", "F32"))
        files = [(f["name"], f["kind"], f["group"], f["size"]) for f in obj["files"]]
        checksums = tuple(RangeRecord(str(f), int(o), int(n), int(c))
                          for f, o, n, c in obj["checksums"])
        extra = {k: obj.get(k, {}) for k in ("config", "topology", "state", "base")}
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"malformed manifest: {type(err).__name__}: {err}") from None
    if files != [(f.name, f.kind, f.group, f.size) for f in layout.files]:
        raise ValueError("manifest files do not match the layout of its groups and shapes")
    check_tiling(layout, checksums)
    return Manifest(layout, checksums, **extra)


def check_tiling(layout: Layout, records: Iterable[RangeRecord]) -> None:
    """Raise ValueError unless ``records`` cover every byte of every file exactly once."""
    by_file: dict[str, list[tuple[int, int]]] = {f.name: [] for f in layout.files}
    for file, offset, length, _ in records:
        if file not in by_file:
            raise ValueError(f"checksum names unknown file {file!r}")
        if offset < 0 or length < 0:
            raise ValueError(f"{file}: negative checksum range ({offset}, {length})")
        if length:
            by_file[file].append((offset, offset + length))
    for f in layout.files:
        cursor = 0
        for begin, end in sorted(by_file[f.name]):
            if begin != cursor:
                raise ValueError(f"{f.name}: bytes [{min(begin, cursor)}, {max(begin, cursor)}) "
                                 f"are {'not covered' if begin > cursor else 'covered twice'}")
            cursor = end
        if cursor < f.size:
            raise ValueError(f"{f.name}: bytes [{cursor}, {f.size}) are not covered")
        if cursor > f.size:
            raise ValueError(f"{f.name}: checksummed ranges run to byte {cursor}, past its end")
