"""Bucketed parameter all-gathers: run the buckets of ``moezero.zero.buckets.plan_gathers``.

A bucket's all-gather sends this rank's columns of each of its groups' shards, concatenated,
and receives a [rows, cols] matrix (row d = DP rank d's columns); ``Launched.unpack`` then
copies each group's element ranges out of it. Used after the step at stages 1-2 and by
``full_parameters`` (``gather_all``: at most two buckets in flight, so the temporaries are
bounded by the bucket size, not the model), and per gather unit at stage 3
(``moezero.zero.gather.ParamGatherer``, which keeps the launched buckets until each group is
needed). Reference counterpart: the ``all_gather`` of ``reference/zero.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moezero.zero.buckets import GatherBucket, GroupColumns

# torch 2.13 renamed the tensor forms; older versions only have the *_tensor names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

Write = Callable[[int, int, torch.Tensor], None]  # (group element lo, hi, values)


@dataclass(eq=False)
class Launched:
    """One bucket's all-gather in flight: its buffers and the collective's work."""

    bucket: GatherBucket
    send: list[torch.Tensor]  # this rank's columns of each piece (one buffer when concatenated)
    recv: torch.Tensor | None  # [rows, cols]; None with one rank: the pieces are read as sent
    held: int  # bytes of the temporaries: a concatenated send buffer, a fresh receive buffer
    work: object | None = None
    _pieces_of: dict | None = None  # group key -> [(piece index, column start, stop, at)]

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def unpack(self, key: int, columns: GroupColumns, write: Write) -> None:
        """Wait, then ``write(lo, hi, values)`` each element range [lo, hi) of group ``key``
        that this bucket holds (padding is never written)."""
        self.wait()
        for j, a, b, col in self._pieces()[key]:
            for d, lo, hi in columns.cells(a, b):
                values = self.send[j] if self.recv is None else self.recv[d, col:]
                write(lo, hi, values[:hi - lo])

    def _pieces(self) -> dict:
        """Each group's pieces with their first column in the bucket (built once: a bucket
        may hold thousands of groups)."""
        if self._pieces_of is None:
            self._pieces_of, col = {}, 0
            for j, (k, a, b) in enumerate(self.bucket.pieces):
                self._pieces_of.setdefault(k, []).append((j, a, b, col))
                col += b - a
        return self._pieces_of


def launch(bucket: GatherBucket, shard_of: Callable[[int], torch.Tensor], group, *,
           out: torch.Tensor | None = None) -> Launched:
    """Start ``bucket``'s all-gather (asynchronously; none when its group has one rank).

    ``shard_of(key)`` is group ``key``'s shard on the compute device; ``out``, for a bucket
    that is one whole unpadded group (``GatherBucket.whole``), receives in place.
    """
    parts = [shard_of(key)[a:b] for key, a, b in bucket.pieces]
    if bucket.rows == 1:  # nothing to exchange: each piece is copied out as it is
        return Launched(bucket, parts, None, 0)
    send = parts[0] if len(parts) == 1 else torch.cat(parts)
    recv = out if out is not None else send.new_empty(bucket.rows * bucket.cols)
    held = (0 if len(parts) == 1 else _nbytes(send)) + (0 if out is not None else _nbytes(recv))
    work = _all_gather(recv, send, group=group, async_op=True)
    return Launched(bucket, [send], recv.view(bucket.rows, bucket.cols), held, work)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def gather_all(buckets: Sequence[GatherBucket], columns: Sequence[GroupColumns],
               shard_of: Callable[[int], torch.Tensor], group_of: Callable[[str], object],
               regions: Sequence[torch.Tensor], *, meter=None, depth: int = 2) -> None:
    """Run ``buckets`` in order, at most ``depth`` in flight, so that group ``key``'s elements
    land in ``regions[key]`` (a flat tensor of its ``numel`` elements); ``columns[key]`` is its
    reduce-scatter view. A whole unpadded group is gathered straight into its region."""
    flight: deque = deque()
    for bucket in buckets:
        key = bucket.pieces[0][0]
        direct = bucket.rows > 1 and bucket.whole(columns[key])
        done = launch(bucket, shard_of, group_of(bucket.channel),
                      out=regions[key] if direct else None)
        if meter is not None:
            meter.hold(done.held)
        flight.append((done, direct))
        if len(flight) >= depth:
            _finish(*flight.popleft(), columns, regions, meter)
    while flight:
        _finish(*flight.popleft(), columns, regions, meter)


def _finish(done: Launched, direct: bool, columns: Sequence[GroupColumns],
            regions: Sequence[torch.Tensor], meter) -> None:
    done.wait()
    if not direct:
        for key in dict.fromkeys(k for k, _, _ in done.bucket.pieces):
            done.unpack(key, columns[key],
                        lambda lo, hi, v, region=regions[key]: region[lo:hi].copy_(v))
    if meter is not None:
        meter.drop(done.held)
