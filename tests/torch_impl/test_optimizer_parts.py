"""The pieces the optimizer owns, each built alone from what it is given (no optimizer): the
checkpoints' view of the state (``zero.state_view``), the fp32 states (``zero.states``), the
frozen weights (``zero.frozen``) and the swap files by tier (``zero.swaps``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from moezero.plan.partition import Partition
from moezero.plan.specs import Slice
from moezero.zero.frozen import FrozenWeights
from moezero.zero.shards import Slot
from moezero.zero.state_view import StateView
from moezero.zero.states import OptimizerStates
from moezero.zero.swaps import Swaps, build_swaps

# One group of 5 elements over 2 DP ranks: shards of 3, rank 1 holds elements [3, 5) + 1 pad.
PART = Partition("g", 2, 1, 5, 6, 3, ((Slice("w", 0, 5), 0),))


def whole_group_slot() -> Slot:
    """A slot holding the whole group (stage 0), seen from DP rank 1."""
    master = torch.arange(5, dtype=torch.float32)
    return Slot(SimpleNamespace(partition=PART), 0, 1, None, master=master,
                exp_avg=master + 10, exp_avg_sq=master + 20)


def view_of(slot: Slot, finished: list) -> StateView:
    def finish():  # the step behind the forward ends: a new master (read before: the old)
        slot.master = slot.master + 100
        finished.append(True)
    return StateView(OptimizerStates([slot]), FrozenWeights([]), local=lambda s: s.rank_range(1),
                     load_ranges=lambda s: [(d, *s.rank_range(d)) for d in (0, 1)],
                     finish=finish)


def test_the_view_finishes_the_step_behind_before_it_hands_out_this_ranks_range():
    slot, finished = whole_group_slot(), []
    (shard,) = view_of(slot, finished).shards()
    assert finished == [True] and shard.dp_rank == 1
    assert shard.tensors["master"].tolist() == [103.0, 104.0]
    assert shard.tensors["exp_avg_sq"].tolist() == [23.0, 24.0]


def test_load_targets_and_pieces_are_lazy_and_cover_the_ranges_given():
    slot, finished = whole_group_slot(), []
    view = view_of(slot, finished)
    targets, pieces = view.load_targets(), view.state_pieces()
    assert finished == []  # nothing runs before the consumer reads
    assert [(t.dp_rank, t.tensors["exp_avg"].tolist()) for t in targets] == [
        (0, [10.0, 11.0, 12.0]), (1, [13.0, 14.0])]
    (piece, views), = list(pieces)
    assert len(finished) == 2 and piece == Slice("w", 3, 5)
    assert views["master"].tolist() == [203.0, 204.0]


class ParamFiles:
    """Param swap files in memory, recording what the frozen weights do with them."""

    def __init__(self, shard: torch.Tensor) -> None:
        self.stored, self.puts, self.drops = shard, [], 0

    def load(self, slot):
        return {"param": self.stored.clone()}

    def put(self, slot, values):
        self.puts.append(values["param"].clone())

    def drop(self, bufs):
        self.drops += 1


def test_frozen_weights_of_a_swapped_shard_go_back_to_their_file_on_load_only():
    files = ParamFiles(torch.tensor([1.0, 2.0, 0.0], dtype=torch.bfloat16))
    frozen = FrozenWeights([Slot(SimpleNamespace(partition=PART), 0, 1, None)], sharded=True,
                           swap=files)
    (saved,) = frozen.shards(load=False)
    assert saved.dp_rank == 1 and saved.tensors["master"].dtype == torch.float32
    assert saved.tensors["master"].tolist() == [1.0, 2.0, 0.0]  # the padded shard
    assert files.puts == [] and files.drops == 1
    for target in frozen.shards(load=True):
        target.tensors["master"].fill_(7.0)
    assert [p.tolist() for p in files.puts] == [[7.0, 7.0, 7.0]]
    assert files.puts[0].dtype == torch.bfloat16 and files.drops == 2


def test_frozen_weights_of_a_whole_group_load_every_ranks_range():
    param = torch.zeros(5)
    frozen = FrozenWeights([Slot(SimpleNamespace(partition=PART), 0, 1, None, param=param)])
    assert [s.dp_rank for s in frozen.shards(load=False)] == [1]
    for target in frozen.shards(load=True):
        target.tensors["master"].fill_(target.dp_rank + 1.0)
    assert param.tolist() == [1.0, 1.0, 1.0, 2.0, 2.0]  # fp32: the views themselves


class Files:
    def __init__(self, read: int) -> None:
        self.traffic, self.closed = {"read": read, "write": 0, "wait_s": 0}, []

    def close(self, *, remove: bool) -> None:
        self.closed.append(remove)


def test_swaps_report_traffic_by_tier_and_remove_their_files():
    optim, grad = Files(3), Files(5)
    swaps = build_swaps(lambda slots, meter: (optim, None, grad), [], None)
    assert swaps.traffic() == {"optim_read": 3, "optim_write": 0, "optim_wait_s": 0,
                               "param_read": 0, "param_write": 0, "param_wait_s": 0,
                               "grad_read": 5, "grad_write": 0, "grad_wait_s": 0}
    swaps.close()
    assert optim.closed == [True] and grad.closed == [True]
    assert build_swaps(None, [], None) == Swaps()
    seen = build_swaps(lambda slots, meter, frozen=(): (None, frozen, None), [], None, ["f"])
    assert seen.param == ["f"]
