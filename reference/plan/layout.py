"""The checkpoint layout: which tensor lies at which byte of which file (docs/checkpoint.md).

A pure function of (groups, parameter shapes, step). Optimizer group ``i`` of ``G`` gets
one ``model-{i+1:05d}-of-{G:05d}.safetensors`` file (fp32 master) and one ``optim-…`` file
(all members' ``exp_avg``, then all members' ``exp_avg_sq``), tensors in group order. A
file's data is therefore the group's unpadded flat buffer (one buffer per state), so a
rank's ZeRO partition is one contiguous byte range per state (``rank_ranges``). Buffers
(checkpointed, never optimized: ``moezero.plan.model_buffers``) are in no group; they lie whole in
one more file, ``buffers.safetensors``, when the model has any. A frozen group
(``GroupPlan.frozen``) has its model file only: its weights, no moments. A weights-only
layout may hold the model files in ``BF16`` or ``F16`` (``dtype``: an import in the source's
dtype); readers upcast them exactly.

Keys: a member that is a whole parameter is stored under its name (``fqn``,
``fqn.exp_avg``, ``fqn.exp_avg_sq``) with its shape. A member the group cap cut is stored
1-D under ``{name}@{start}:{stop}`` (element range of the flattened parameter); see
docs/checkpoint.md for reassembly. Headers are built byte-for-byte from the layout, so any
rank knows every data offset without reading a file.

The manifest's pure half (``Manifest``, ``manifest_to_json``/``manifest_from_json``) is
``moezero.plan.manifest``; file I/O is in ``moezero.plan.store``. Torch counterpart:
``moezero.checkpoint.core`` (calls ``plan_layout``, ``rank_ranges`` and the store).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from moezero.plan.encoding import ITEMSIZE, WEIGHT_DTYPES, check_dtype, safetensors_header
from moezero.plan.grouping import GroupPlan, locate_params
from moezero.plan.model_buffers import BUFFERS_FILE
from moezero.plan.partition import Partition
from moezero.plan.rules import MASTER, MOMENTS, STATES
from moezero.plan.specs import ParamSpec, Slice, natural_key

FORMAT_VERSION = 1
INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "manifest.json"


class TensorEntry(NamedTuple):
    """One tensor of a file: element range ``[start, stop)`` of ``fqn``'s ``state``.

    ``begin``/``end`` are byte offsets from the start of the file's data section.
    """

    key: str
    fqn: str
    state: str
    start: int
    stop: int
    shape: tuple[int, ...]
    begin: int
    itemsize: int = ITEMSIZE

    @property
    def end(self) -> int:
        """Byte offset one past the tensor's last byte (relative to the data start)."""
        return self.begin + (self.stop - self.start) * self.itemsize


class ByteRange(NamedTuple):
    """``length`` bytes at absolute ``offset`` of checkpoint file ``file``."""

    file: str
    offset: int
    length: int


class RankRanges(NamedTuple):
    """Where one DP rank's partition of a group lies on disk, per state.

    ``numel`` is the number of real (unpadded) elements of the shard that go to disk; the
    rank writes ``shard[:numel]`` of each state at the given range. The moments are ``None``
    in a weights-only layout.
    """

    master: ByteRange
    exp_avg: ByteRange | None
    exp_avg_sq: ByteRange | None
    numel: int


class RangeRecord(NamedTuple):
    """A checksummed byte range (``crc32`` from zlib) as stored in the manifest."""

    file: str
    offset: int
    length: int
    crc32: int


@dataclass(frozen=True)
class FileLayout:
    """One safetensors file: its name, group, tensors and exact header bytes."""

    name: str
    kind: str  # "model" or "optim"
    group: str
    tensors: tuple[TensorEntry, ...]
    header: bytes = field(repr=False)
    dtype: str = "F32"  # safetensors tag of every tensor of the file

    @property
    def itemsize(self) -> int:
        """Bytes per element of the file's tensors."""
        return WEIGHT_DTYPES[self.dtype]

    @property
    def data_start(self) -> int:
        """Absolute offset of the data section (8-byte length + padded JSON)."""
        return len(self.header)

    @property
    def data_size(self) -> int:
        """Bytes of tensor data."""
        return self.tensors[-1].end if self.tensors else 0

    @property
    def size(self) -> int:
        """Size of the whole file in bytes."""
        return self.data_start + self.data_size


@dataclass(frozen=True)
class Layout:
    """Every checkpoint file of a plan, indexed by group (``model_files[i]`` is group i)."""

    step: int
    groups: tuple[GroupPlan, ...]
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    model_files: tuple[FileLayout, ...]
    optim_files: tuple[FileLayout, ...]
    buffers: tuple[tuple[str, tuple[int, ...]], ...] = ()
    buffer_file: FileLayout | None = None
    dtype: str = "F32"  # of the model files (weights only may be "BF16" or "F16")

    @property
    def files(self) -> tuple[FileLayout, ...]:
        """All files: model files, optim files, then the buffer file (if any)."""
        extra = () if self.buffer_file is None else (self.buffer_file,)
        return self.model_files + self.optim_files + extra

    @property
    def weights_only(self) -> bool:
        """True for a layout of master weights without optimizer state (no optim files),
        e.g. a model imported from Hugging Face; a loader starts the Adam moments at zero."""
        return bool(self.model_files) and not self.optim_files

    @cached_property
    def _by_name(self) -> dict[str, FileLayout]:
        return {f.name: f for f in self.files}

    @cached_property
    def _pieces(self) -> dict[tuple[str, str], tuple[tuple[FileLayout, TensorEntry], ...]]:
        out: dict[tuple[str, str], list] = {}
        for f in self.files:
            for t in f.tensors:
                out.setdefault((t.fqn, t.state), []).append((f, t))
        return {k: tuple(sorted(v, key=lambda p: p[1].start)) for k, v in out.items()}

    def file(self, name: str) -> FileLayout:
        """The file called ``name``; KeyError if the layout has none."""
        return self._by_name[name]

    @cached_property
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.shapes + self.buffers)

    def shape(self, fqn: str) -> tuple[int, ...]:
        """The full shape of parameter or buffer ``fqn``; KeyError if it is not in the
        checkpoint."""
        return self._shapes[fqn]

    def pieces(self, fqn: str, state: str = MASTER) -> tuple[tuple[FileLayout, TensorEntry], ...]:
        """The (file, tensor) pieces holding ``fqn``'s ``state``, in element order."""
        _check_state(state)
        if state != MASTER and self.weights_only:
            raise KeyError(f"a weights-only checkpoint has no {state} of {fqn!r}")
        if (fqn, state) not in self._pieces:
            if fqn in self.frozen:  # saved frozen: weights only, its moments read as zeros
                return ()
            raise KeyError(f"parameter {fqn!r} is not in the checkpoint")
        return self._pieces[(fqn, state)]

    @cached_property
    def frozen(self) -> frozenset[str]:
        """The FQNs saved in frozen groups (weights only)."""
        return frozenset(m.fqn for g in self.groups if g.frozen for m in g.members)

    def optim_file(self, index: int) -> FileLayout | None:
        """The optim file of group ``index``; None for a frozen group or weights only."""
        name = self.groups[index].name
        return next((f for f in self.optim_files if f.group == name), None)

    def group_index(self, name: str) -> int:
        """Index of the group called ``name``; KeyError if absent."""
        for group in self.groups:
            if group.name == name:
                return group.index
        raise KeyError(f"group {name!r} is not in the checkpoint")

    def describe(self) -> str:
        """One line per file: name, group, tensor count, header and data bytes."""
        return "\n".join(f"{f.name}  {f.group}  {len(f.tensors)} tensors  header {f.data_start} B"
                         f"  data {f.data_size} B" for f in self.files)


def fragment_key(name: str, start: int, stop: int) -> str:
    """The key of elements ``[start, stop)`` of the flattened tensor ``name``."""
    return f"{name}@{start}:{stop}"


def parse_key(key: str) -> tuple[str, int | None, int | None]:
    """``(name, start, stop)`` of a stored key; ``start = stop = None`` for a whole tensor."""
    name, sep, span = key.rpartition("@")
    if not sep:
        return key, None, None
    start, stop = span.split(":")
    return name, int(start), int(stop)


def shapes_of(specs: Iterable[ParamSpec]) -> dict[str, tuple[int, ...]]:
    """``{fqn: shape}`` from parameter specs, the shape input of ``plan_layout``."""
    return {s.fqn: s.shape for s in specs}


def plan_layout(groups: Sequence[GroupPlan], shapes: Mapping[str, Sequence[int]], *,
                step: int, weights_only: bool = False,
                buffers: Mapping[str, Sequence[int]] | None = None,
                dtype: str = "F32") -> Layout:
    """The checkpoint layout of a plan at ``step``.

    Args:
        groups: The plan from ``plan_groups`` (every parameter's elements exactly once).
        shapes: Full shape of every parameter in ``groups`` (``shapes_of(specs)``).
        step: Optimizer step, recorded in each header's metadata.
        weights_only: Model files only (the masters), no optim files.
        buffers: Full shape of every buffer (``moezero.plan.model_buffers``): stored whole, in
            natural FQN order, in ``buffers.safetensors``; none: no such file.
        dtype: The safetensors tag of the model files' tensors: ``F32``, or for a weights-only
            layout ``BF16``/``F16`` (a frozen base kept in its source dtype, docs/hf.md);
            optimizer state and buffers are always ``F32``. Readers upcast exactly.

    Raises:
        ValueError: (one line) if shapes and groups disagree, a buffer is also a parameter,
            an FQN contains ``@``, or the dtype is unknown or not F32 with optimizer state.
    """
    shapes = {fqn: tuple(int(d) for d in shape) for fqn, shape in shapes.items()}
    _check_coverage(groups, shapes)
    check_dtype(dtype, weights_only)
    num = len(groups)
    model = tuple(_file("model", g, num, shapes, step, dtype) for g in groups)
    optim = () if weights_only else tuple(_file("optim", g, num, shapes, step)
                                          for g in groups if not g.frozen)
    order = [m.fqn for g in groups for m in g.members if m.start == 0]
    kept = _buffer_shapes(buffers or {}, shapes)
    return Layout(step, tuple(groups), tuple((f, shapes[f]) for f in order), model, optim,
                  kept, _buffer_file(kept, step) if kept else None, dtype)


def _buffer_shapes(buffers: Mapping[str, Sequence[int]], params: Mapping) -> tuple:
    both = sorted(set(buffers) & set(params))
    if both:
        raise ValueError(f"{both[0]!r} is both a parameter and a buffer")
    if any("@" in fqn for fqn in buffers):
        raise ValueError(f"buffer {next(f for f in buffers if '@' in f)!r}: '@' is reserved")
    return tuple((fqn, tuple(int(d) for d in buffers[fqn]))
                 for fqn in sorted(buffers, key=natural_key))


def _buffer_file(buffers: tuple, step: int) -> FileLayout:
    tensors, cursor = [], 0
    for fqn, shape in buffers:
        tensors.append(TensorEntry(fqn, fqn, "master", 0, math.prod(shape), shape, cursor))
        cursor = tensors[-1].end
    metadata = {"format": "pt", "moezero.format_version": str(FORMAT_VERSION),
                "moezero.kind": "buffers", "moezero.step": str(step)}
    return FileLayout(BUFFERS_FILE, "buffers", "buffers", tuple(tensors),
                      _header(metadata, tensors))


def _check_coverage(groups: Sequence[GroupPlan], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every FQN of ``shapes`` is tiled exactly by the groups' slices, and vice versa."""
    located = locate_params(groups)
    for fqn, pieces in located.items():
        if "@" in fqn:
            raise ValueError(f"param {fqn!r}: '@' is reserved for fragment keys")
        if fqn not in shapes:
            raise ValueError(f"param {fqn!r} is in the groups but has no shape")
        bounds = [0] + [s.stop for _, s in pieces]
        if [s.start for _, s in pieces] != bounds[:-1] or bounds[-1] != math.prod(shapes[fqn]):
            raise ValueError(f"param {fqn!r}: group slices do not tile its {math.prod(shapes[fqn])} "
                             f"elements: {[(s.start, s.stop) for _, s in pieces]}")
    missing = sorted(set(shapes) - set(located))
    if missing:
        raise ValueError(f"param {missing[0]!r} has a shape but is in no group")


def file_name(kind: str, index: int, num_groups: int) -> str:
    """``model-00001-of-00003.safetensors`` for ``kind="model", index=0, num_groups=3``."""
    return f"{kind}-{index + 1:05d}-of-{num_groups:05d}.safetensors"


def _file(kind: str, group: GroupPlan, num_groups: int, shapes: dict, step: int,
          dtype: str = "F32") -> FileLayout:
    states = (MASTER,) if kind == "model" else MOMENTS
    tensors, cursor = [], 0
    for state in states:
        for member in group.members:
            tensors.append(_entry(member, state, shapes[member.fqn], cursor,
                                  WEIGHT_DTYPES[dtype]))
            cursor = tensors[-1].end
    metadata = {"format": "pt", "moezero.format_version": str(FORMAT_VERSION),
                "moezero.kind": kind, "moezero.group": group.name, "moezero.step": str(step)}
    return FileLayout(file_name(kind, group.index, num_groups), kind, group.name,
                      tuple(tensors), _header(metadata, tensors, dtype), dtype)


def _entry(member: Slice, state: str, shape: tuple[int, ...], begin: int,
           itemsize: int = ITEMSIZE) -> TensorEntry:
    name = member.fqn if state == MASTER else f"{member.fqn}.{state}"
    if member.numel == math.prod(shape):
        return TensorEntry(name, member.fqn, state, 0, member.stop, shape, begin, itemsize)
    return TensorEntry(fragment_key(name, member.start, member.stop), member.fqn, state,
                       member.start, member.stop, (member.numel,), begin, itemsize)


def _header(metadata: dict[str, str], tensors: Sequence[TensorEntry],
            dtype: str = "F32") -> bytes:
    return safetensors_header(metadata, ((t.key, dtype, t.shape, t.begin, t.end)
                                         for t in tensors))


def rank_ranges(layout: Layout, partition: Partition, dp_rank: int) -> RankRanges:
    """The byte ranges of DP rank ``dp_rank``'s partition of a group, clipped to the data.

    The partition must be of a group of this layout with the same members (any world size
    or alignment). Padding never reaches disk: a rank whose shard is all padding gets
    zero-length ranges. A weights-only layout has no moment ranges (``None``).
    """
    index = _matching_group(layout, partition)
    lo, hi = partition.rank_range(dp_rank)
    lo, hi = min(lo, partition.numel), min(hi, partition.numel)
    model = layout.model_files[index]
    master = ByteRange(model.name, model.data_start + lo * model.itemsize,
                       (hi - lo) * model.itemsize)
    optim = layout.optim_file(index)
    if optim is None:  # weights only, or a frozen group
        return RankRanges(master, None, None, hi - lo)
    avg, length = optim.data_start + lo * ITEMSIZE, (hi - lo) * ITEMSIZE
    return RankRanges(master, ByteRange(optim.name, avg, length),
                      ByteRange(optim.name, avg + partition.numel * ITEMSIZE, length), hi - lo)


def _matching_group(layout: Layout, partition: Partition) -> int:
    """Index of the saved group ``partition`` is of; ValueError unless its members match."""
    try:
        index = layout.group_index(partition.group)
    except KeyError:
        raise ValueError(f"group {partition.group!r} is not in the saved plan") from None
    if layout.groups[index].members != tuple(m for m, _ in partition.offsets):
        raise ValueError(f"group {partition.group!r}: members differ from the saved plan")
    return index


def same_group(layout: Layout, partition: Partition) -> bool:
    """True if ``partition`` is of a saved group with identical members (fast path applies)."""
    try:
        _matching_group(layout, partition)
    except ValueError:
        return False
    return True


def index_json(layout: Layout) -> dict:
    """``model.safetensors.index.json``: ``weight_map`` {key: file} and ``total_size``."""
    files = layout.model_files + ((layout.buffer_file,) if layout.buffer_file else ())
    weight_map = {t.key: f.name for f in files for t in f.tensors}
    total = sum(f.data_size for f in files)
    return {"metadata": {"total_size": total, "format": "moezero", "step": layout.step},
            "weight_map": weight_map}


def _check_state(state: str) -> None:
    if state not in STATES:
        raise ValueError(f"state must be one of {STATES}, got {state!r}")
