"""Topology: EP blocks and EDP groups for W = 1, 2, 4 and ep = 1, 2, 4."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moezero.distributed.topology import build_topology, validate
from tests.support.world import run_world


def groups_of_rank(ep_sizes: list[int]) -> dict:
    topo = build_topology(ep_sizes, num_experts=8)
    out = {"rank": topo.rank, "world": topo.world_size}
    for ep in ep_sizes:
        ranks = (lambda g: dist.get_process_group_ranks(g)) if topo.distributed else (lambda g: [0])
        out[ep] = {"ep": ranks(topo.ep_group(ep)), "edp": ranks(topo.edp_group(ep)),
                   "ep_rank": topo.ep_rank(ep), "edp_rank": topo.edp_rank(ep)}
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_groups(tmp_path, world):
    eps = [ep for ep in (1, 2, 4) if ep <= world]
    results = run_world(groups_of_rank, world, tmp_path, eps)
    # Expected by hand: EP groups are consecutive blocks, EDP groups stride by ep.
    expected = {
        (4, 2): {0: ([0, 1], [0, 2]), 1: ([0, 1], [1, 3]), 2: ([2, 3], [0, 2]), 3: ([2, 3], [1, 3])},
        (4, 4): {r: ([0, 1, 2, 3], [r]) for r in range(4)},
        (4, 1): {r: ([r], [0, 1, 2, 3]) for r in range(4)},
        (2, 2): {0: ([0, 1], [0]), 1: ([0, 1], [1])},
        (2, 1): {0: ([0], [0, 1]), 1: ([1], [0, 1])},
        (1, 1): {0: ([0], [0])},
    }
    for res in results:
        for ep in eps:
            ep_ranks, edp_ranks = expected[(world, ep)][res["rank"]]
            assert res[ep]["ep"] == ep_ranks and res[ep]["edp"] == edp_ranks
            assert res[ep]["ep_rank"] == ep_ranks.index(res["rank"])
            assert res[ep]["edp_rank"] == edp_ranks.index(res["rank"])


@pytest.mark.parametrize("world,ep,experts,key", [(4, 3, 6, "does not divide world_size 4"),
                                                  (4, 4, 6, "does not divide num_experts 6"),
                                                  (2, 0, 8, "must be >= 1, got 0")])
def test_invalid_ep_is_a_one_line_error(world, ep, experts, key):
    with pytest.raises(ValueError, match=key) as info:
        validate(world, ep, experts)
    assert "\n" not in str(info.value) and str(info.value).startswith("moe.ep_size:")
