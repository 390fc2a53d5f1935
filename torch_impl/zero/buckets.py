"""The plan of the gradient reduction as frozen data: which columns of which groups travel
together in one bucket (pure: no tensors, no process group).

**Columns.** A group's ``numel`` elements are seen as a [rows, cols] matrix whose row d holds
the elements ``[d * cols, (d + 1) * cols)`` (elements past ``numel`` are padding and are never
read). The sharded optimizer reduce-scatters: rows = the group's ``dp_size``, cols =
``shard_numel``, so one collective over a column range gives every DP rank its slice of its
shard. The replicated optimizer all-reduces: one row of ``numel`` columns.

**Buckets.** Column ranges of the groups of one kind (groups sharing a process group), at most
``cap`` elements of send buffer each (``cap // rows`` columns), in the order backward is
expected to finish the groups: by the registration (~forward) order of their first parameter,
last first. Every rank of a data-parallel group computes the same plan, so every rank issues
its collectives in the same order. Used by ``moezero.zero.reduce``.

**Gather buckets** (``plan_gathers``): the other way round, the parameter all-gathers of
stages 1-3 (after the step at stages 1-2, per gather unit at stage 3). Each listed group's
shard columns, channel by channel (groups sharing a process group), cut into buckets of at
most ``cap`` elements of receive buffer (rows x cols): every rank sends its columns of the
bucket's groups, concatenated, and receives every rank's, so the number of all-gathers grows
with the bytes gathered, not with the number of optimizer groups. ``cap=None`` gives one
bucket per group (the per-group gathers of before). Used by ``moezero.zero.allgather``.
Reference counterpart: the ``psum_scatter`` and ``all_gather`` of ``reference/zero.py``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from moezero.plan.partition import Partition


@dataclass(frozen=True)
class GroupColumns:
    """One group as a [rows, cols] matrix of its elements (row-major, padding at the end)."""

    partition: Partition
    rows: int
    cols: int
    starts: tuple[int, ...] = field(default=(), repr=False, compare=False)  # member offsets

    @property
    def numel(self) -> int:
        return self.partition.numel

    def cells(self, a: int, b: int) -> Iterator[tuple[int, int, int]]:
        """(row d, lo, hi): the group elements [lo, hi) of columns [a, b) in row d."""
        for d in range(self.rows):
            lo, hi = d * self.cols + a, min(d * self.cols + b, self.numel)
            if lo < hi:
                yield d, lo, hi

    def members_in(self, lo: int, hi: int) -> Iterator[tuple[str, int, int, int]]:
        """(fqn, param element start, start in [lo, hi), count) of members overlapping it."""
        offsets = self.partition.offsets
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while i < len(offsets) and offsets[i][1] < hi:
            member, off = offsets[i]
            start, stop = max(lo, off), min(hi, off + member.numel)
            if start < stop:
                yield member.fqn, member.start + start - off, start - lo, stop - start
            i += 1


def scatter_columns(partition: Partition) -> GroupColumns:
    """Reduce-scatter view: a row per DP rank, a shard per row."""
    return GroupColumns(partition, partition.dp_size, partition.shard_numel, _starts(partition))


def full_columns(partition: Partition) -> GroupColumns:
    """All-reduce view: one row holding the whole group."""
    return GroupColumns(partition, 1, partition.numel, _starts(partition))


def _starts(partition: Partition) -> tuple[int, ...]:
    return tuple(off for _, off in partition.offsets)


@dataclass(frozen=True)
class Bucket:
    """Column ranges of one kind's groups reduced by one collective."""

    kind: int  # index of the kind (process group)
    pieces: tuple[tuple[int, int, int], ...]  # (group index in the kind, column start, stop)
    fqns: tuple[str, ...]  # params it reads, in first-seen order

    @property
    def cols(self) -> int:
        return sum(b - a for _, a, b in self.pieces)


def plan_buckets(kinds: Sequence[Sequence[GroupColumns]], order: Mapping[str, int],
                 cap: int) -> tuple[Bucket, ...]:
    """Every kind's columns cut into buckets of at most ``cap`` send-buffer elements.

    Args:
        kinds: Per kind (one process group), its groups' columns; all with the same ``rows``.
        order: Each parameter's registration position (backward finishes late ones first).
        cap: ``reduce_bucket_size``: elements of one bucket's [rows, cols] send buffer.
    """
    buckets = []
    for k, groups in enumerate(kinds):
        if groups:
            buckets += _kind_buckets(k, groups, order, max(1, cap // groups[0].rows))
    return tuple(buckets)


def _kind_buckets(k: int, groups: Sequence[GroupColumns], order: Mapping[str, int],
                  cols_cap: int) -> list[Bucket]:
    first_use = [min(order[m.fqn] for m, _ in g.partition.offsets) for g in groups]
    ordered = sorted(range(len(groups)), key=lambda i: -first_use[i])
    return [_bucket(k, groups, pieces)
            for pieces in _cut([(gi, groups[gi].cols) for gi in ordered], cols_cap)]


def _cut(widths: Sequence[tuple[int, int]], cols_cap: int) -> Iterator[list]:
    """(key, width) items' columns, in order, as lists of (key, start, stop) pieces of
    ``cols_cap`` columns each (the last may be shorter)."""
    pieces, cols = [], 0
    for key, width in widths:
        a = 0
        while a < width:
            b = min(width, a + cols_cap - cols)
            pieces.append((key, a, b))
            cols, a = cols + b - a, b
            if cols == cols_cap:
                yield pieces
                pieces, cols = [], 0
    if pieces:
        yield pieces


def _bucket(k: int, groups: Sequence[GroupColumns], pieces: list) -> Bucket:
    fqns: dict[str, None] = {}
    for gi, a, b in pieces:
        for _, lo, hi in groups[gi].cells(a, b):
            fqns.update((fqn, None) for fqn, *_ in groups[gi].members_in(lo, hi))
    return Bucket(k, tuple(pieces), tuple(fqns))


@dataclass(frozen=True)
class GatherBucket:
    """Shard columns of groups on one process group, all-gathered by one collective.

    Every rank sends its columns ``[a, b)`` of each piece's shard, concatenated in piece order
    (``cols`` elements); the result is a [rows, cols] matrix whose row d is DP rank d's.
    """

    channel: str  # the process group's name (``Kind.channel``)
    rows: int  # its size (the groups' dp_size)
    pieces: tuple[tuple[int, int, int], ...]  # (group key, column start, stop)

    @property
    def cols(self) -> int:
        return sum(b - a for _, a, b in self.pieces)

    def whole(self, columns: GroupColumns) -> bool:
        """One piece holding all of one unpadded group: rank d's row is the group's elements
        ``[d * cols, (d + 1) * cols)``, so the gather can land in the group's storage as is."""
        if len(self.pieces) != 1:
            return False
        _, a, b = self.pieces[0]
        return a == 0 and b == columns.cols and columns.rows * columns.cols == columns.numel


def plan_gathers(groups: Sequence[tuple[int, str, GroupColumns]],
                 cap: int | None) -> tuple[GatherBucket, ...]:
    """The all-gather buckets of ``groups``, channel by channel in first-seen order.

    Args:
        groups: (key, channel, columns) of each group to gather, in gather order; its
            columns are the reduce-scatter view (``scatter_columns``: a row per DP rank).
        cap: ``allgather_bucket_size``: elements of one bucket's receive buffer (at least one
            column); None: one bucket per group, whole.
    """
    channels: dict[str, list[tuple[int, GroupColumns]]] = {}
    for key, channel, columns in groups:
        channels.setdefault(channel, []).append((key, columns))
    buckets = []
    for channel, members in channels.items():
        rows = members[0][1].rows
        if cap is None:
            cuts = [[(key, 0, c.cols)] for key, c in members if c.cols]
        else:
            cuts = _cut([(key, c.cols) for key, c in members], max(1, cap // rows))
        buckets += [GatherBucket(channel, rows, tuple(pieces)) for pieces in cuts]
    return tuple(buckets)


def plan_windows(sizes: Sequence[int], limit: int) -> tuple[tuple[int, ...], ...]:
    """Consecutive indices of ``sizes`` in windows whose sizes sum to at most ``limit`` (an
    item larger than ``limit`` is a window alone): the offloaded step's windows of groups
    (``ZeroOptions.host_window``), each stepped by one vectorised AdamW."""
    windows: list[tuple[int, ...]] = []
    window: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if window and total + n > limit:
            windows.append(tuple(window))
            window, total = [], 0
        window.append(i)
        total += n
    if window:
        windows.append(tuple(window))
    return tuple(windows)
