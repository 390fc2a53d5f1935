"""Parameter specs for the plan's tests: a literal example model and hypothesis strategies
of random ones (dense params and MoE layers with a world size valid for them)."""

from __future__ import annotations

from hypothesis import strategies as st

from moezero.plan import ParamSpec

USER_GROUPS = ("decay", "no_decay", "embed")


def expert(fqn, shape, *, layer, e, ep=2, group=None, user_group="decay"):
    """An expert ParamSpec with the moe group named after its ep size by default."""
    return ParamSpec(fqn, shape, user_group=user_group, moe_group=group or f"ep_size_{ep}",
                     ep_size=ep, layer=layer, expert=e)


def example_model():
    """Two dense user groups and two MoE layers (2 experts, ep 2), deliberately out of order."""
    return [
        ParamSpec("layers.10.norm.weight", (3,), user_group="no_decay"),
        expert("layers.10.moe.experts.1.w1.weight", (4,), layer="layers.10.moe", e=1),
        ParamSpec("embed.weight", (2, 3), user_group="decay"),
        expert("layers.2.moe.experts.1.w1.weight", (4,), layer="layers.2.moe", e=1),
        ParamSpec("layers.2.norm.weight", (3,), user_group="no_decay"),
        expert("layers.10.moe.experts.0.w1.weight", (4,), layer="layers.10.moe", e=0),
        expert("layers.2.moe.experts.0.w1.weight", (4,), layer="layers.2.moe", e=0),
    ]


shapes = st.lists(st.integers(1, 5), max_size=2).map(tuple)


@st.composite
def moe_layer(draw, index):
    """All experts' params of one MoE layer: ep in {1, 2, 4}, E a multiple of ep."""
    ep = draw(st.sampled_from((1, 2, 4)))
    group = draw(st.sampled_from((f"ep_size_{ep}", f"custom{ep}")))
    num_experts = ep * draw(st.integers(1, 3))
    names = draw(st.lists(st.sampled_from(("w1", "w2", "w3", "b")), min_size=1, max_size=3, unique=True))
    kinds = [(n, draw(shapes), draw(st.sampled_from(USER_GROUPS))) for n in names]
    layer = f"layers.{index}.moe"
    return [ParamSpec(f"{layer}.experts.{e}.{n}.weight", shape, user_group=ug, moe_group=group,
                      ep_size=ep, layer=layer, expert=e)
            for e in range(num_experts) for n, shape, ug in kinds]


@st.composite
def models(draw):
    """A random model: dense params and MoE layers, with a world size valid for it."""
    specs = [ParamSpec(f"dense.{i}.weight", draw(shapes), user_group=draw(st.sampled_from(USER_GROUPS)))
             for i in range(draw(st.integers(0, 4)))]
    for index in draw(st.lists(st.integers(0, 12), max_size=3, unique=True)):
        specs += draw(moe_layer(index))
    ep_max = max([s.ep_size for s in specs], default=1)
    world_size = ep_max * draw(st.integers(1, 3))
    return draw(st.permutations(specs)), world_size


caps = st.one_of(st.none(), st.integers(1, 6), st.integers(1, 120))
