"""The plan shared by both sides: parameter grouping and ZeRO partitioning (stdlib + numpy).

``plan_groups`` decides which parameter elements form each optimizer group;
``plan_partitions`` decides how each group's flat buffer is split over ranks;
``plan_layout`` decides where every byte of a checkpoint lies, and ``moezero.plan.store``
(import it explicitly) reads and writes it. ``moezero.plan.rules`` holds the conventions both
sides follow (expert FQNs, the expert group's default name, the optimizer state names, the
``ep`` divisibility check, the weight-decay rule). See docs/design.md, "Semantics", docs/grouping.md and
docs/checkpoint.md.
"""

from moezero.plan.grouping import (
    GroupPlan,
    expert_ep_rank,
    group_hparams,
    locate_params,
    plan_groups,
)
from moezero.plan.layout import (
    ByteRange,
    FileLayout,
    Layout,
    RangeRecord,
    RankRanges,
    TensorEntry,
    fragment_key,
    index_json,
    parse_key,
    plan_layout,
    rank_ranges,
    shapes_of,
)
from moezero.plan.manifest import Manifest
from moezero.plan.partition import (
    Partition,
    edp_group_ranks,
    edp_rank,
    ep_group_ranks,
    ep_rank,
    partition_group,
    plan_partitions,
)
from moezero.plan.rules import (
    EXPERTS,
    MASTER,
    MOMENTS,
    STATES,
    ExpertName,
    check_ep_size,
    ep_size_problem,
    expert_fqn,
    expert_group_name,
    parse_expert_fqn,
    weight_decay_applies,
)
from moezero.plan.specs import ParamSpec, Slice, UserGroup, natural_key, user_groups_by_name

__all__ = [
    "EXPERTS",
    "MASTER",
    "MOMENTS",
    "STATES",
    "ExpertName",
    "ep_size_problem",
    "expert_fqn",
    "expert_group_name",
    "parse_expert_fqn",
    "weight_decay_applies",
    "ByteRange",
    "FileLayout",
    "Layout",
    "Manifest",
    "RangeRecord",
    "RankRanges",
    "TensorEntry",
    "fragment_key",
    "index_json",
    "parse_key",
    "plan_layout",
    "rank_ranges",
    "shapes_of",
    "GroupPlan",
    "ParamSpec",
    "Partition",
    "Slice",
    "UserGroup",
    "check_ep_size",
    "edp_group_ranks",
    "edp_rank",
    "ep_group_ranks",
    "ep_rank",
    "expert_ep_rank",
    "group_hparams",
    "locate_params",
    "natural_key",
    "partition_group",
    "plan_groups",
    "plan_partitions",
    "user_groups_by_name",
]
