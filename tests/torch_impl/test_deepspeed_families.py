"""``moezero import-deepspeed`` of DeepSpeed runs of gpt-oss, DeepSeek-V3 and GLM-4.5 (issue 36),
against checkpoints the real DeepSpeed 0.19.8 wrote (tests/fixtures/deepspeed/, its
make_fixtures.py; every tensor random, norm gains not 1, biases not 0):

- the imported masters, Adam moments and the routers' ``e_score_correction_bias`` equal, bit
  for bit, what DeepSpeed's own ``safe_get_full_*`` API gathered at the saved step
  (``state.safetensors``), mapped here by hand from transformers 5's names (gpt-oss's fused
  experts: ``gate_up_proj`` [E, D, 2F] interleaved, ``down_proj`` [E, F, D]);
- one more step after the import lands on DeepSpeed's loss and parameters (fp32, 1e-6
  relative), at moezero's stages 0, 2 and 3 (W = 1) and at W = 2, ep 2;
- what the importer cannot place is one line.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from moezero.checkpoint.deepspeed import import_deepspeed
from moezero.config import load_config
from moezero.plan import store
from tests.support.world import run_world
from tests.torch_impl.test_deepspeed_import import (
    FIXTURES,
    batch,
    check_continuation,
    continue_one_step,
)

CASES = ("gpt_oss_z2_w2", "deepseek_v3_z3_w2", "glm4_moe_z2_w2")
STATES = ("master", "exp_avg", "exp_avg_sq")
_SAME = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.sinks": "attn.sinks", "mlp.router": "moe.router",  # gpt-oss
         "mlp.gate.e_score_correction_bias": "moe.router.expert_bias",  # DeepSeek, GLM
         "mlp.gate": "moe.router", "mlp.gate_proj": "mlp.w1", "mlp.up_proj": "mlp.w3",
         "mlp.down_proj": "mlp.w2", "mlp.shared_experts.gate_proj": "shared.w1",
         "mlp.shared_experts.up_proj": "shared.w3", "mlp.shared_experts.down_proj": "shared.w2",
         "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
         **{f"self_attn.{x}_proj": f"attn.w{x}" for x in "qkvo"}}
_MLA = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
        "kv_b_proj")


def _experts(layer: str, rest: str, t: torch.Tensor, config: dict) -> dict:
    """The routed experts of one fused transformers tensor, per expert in moezero's [out, in]."""
    q, f = f"layers.{layer}.moe.experts.", config.get("moe_intermediate_size") or \
        config["intermediate_size"]
    parts = {  # tensor -> (moezero weight, its part of the expert's slice)
        "gate_up_proj": {"w1.weight": lambda w: w[:, 0::2].t(), "w3.weight": lambda w: w[:, 1::2].t()},
        "gate_up_proj_bias": {"w1.bias": lambda w: w[0::2], "w3.bias": lambda w: w[1::2]},
        "down_proj": {"w2.weight": lambda w: w.t()}, "down_proj_bias": {"w2.bias": lambda w: w},
    } if config["model_type"] == "gpt_oss" else {  # x @ W, gate and up interleaved: above
        "gate_up_proj": {"w1.weight": lambda w: w[:f], "w3.weight": lambda w: w[f:]},
        "down_proj": {"w2.weight": lambda w: w}}  # gate_up [E, 2F, D], down [E, D, F]
    return {f"{q}{e}.{name}": part(w) for e, w in enumerate(t)
            for name, part in parts[rest].items()}


def to_moezero(hf: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """transformers 5 tensors of these families (one state) under moezero's FQNs."""
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "lm_head.weight"}
    out = {}
    for key, t in hf.items():
        if key in top:
            out[top[key]] = t
            continue
        layer, rest = key.removeprefix("model.layers.").split(".", 1)
        if rest.startswith("mlp.experts."):
            out.update(_experts(layer, rest.removeprefix("mlp.experts."), t, config))
            continue
        module, _, leaf = rest.rpartition(".")
        if rest in _SAME:  # a parameter or buffer named without .weight
            out[f"layers.{layer}.{_SAME[rest]}"] = t
        elif module.removeprefix("self_attn.") in _MLA or module == "self_attn.o_proj" and \
                config["model_type"] == "deepseek_v3":
            out[f"layers.{layer}.attn.{module.removeprefix('self_attn.')}.{leaf}"] = t
        else:
            out[f"layers.{layer}.{_SAME[module]}.{leaf}"] = t
    return out


def _config(case: str) -> dict:
    return json.loads((FIXTURES / case / "ckpt" / "config.json").read_text())


def expected_state(case: str, state: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's step-K ``state`` (master: the fp32 weights and the buffers) by FQN."""
    saved = load_file(FIXTURES / case / "state.safetensors")
    suffix = "" if state == "master" else f".{state}"
    keys = [k for k in saved if k.rsplit(".", 1)[-1] not in ("exp_avg", "exp_avg_sq")]
    return to_moezero({k: saved[k + suffix] for k in keys if k + suffix in saved}, _config(case))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_families")
    for case in CASES:
        import_deepspeed(FIXTURES / case / "ckpt", root / case)
    return root


@pytest.mark.parametrize("case", CASES)
def test_masters_moments_and_buffers_equal_deepspeeds_exactly(imported, case):
    step_dir = store.find_checkpoint(imported / case)
    manifest = store.read_manifest(step_dir)
    assert store.verify(step_dir) == []
    buffers = dict(manifest.layout.buffers)
    for state in STATES:
        want = expected_state(case, state)
        fqns = [f for f, _ in manifest.layout.shapes] + (list(buffers) if state == "master"
                                                         else [])
        assert sorted(fqns) == sorted(want), state
        for fqn in fqns:
            got = store.read_param(step_dir, manifest, fqn, state=state)
            assert torch.equal(torch.from_numpy(got), want[fqn].reshape(-1)), (state, fqn)
    cfg = load_config(imported / case / "config.yaml")
    assert cfg.moe.bias_update_rate == 0.0 if buffers else cfg.moe.bias_update_rate > 0


def expected_after(case: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's parameters after step K+1 (its ``zero_to_fp32``), buffers left out."""
    after = to_moezero(load_file(FIXTURES / case / "after.safetensors"), _config(case))
    return {k: v for k, v in after.items() if not k.endswith("expert_bias")}


def check(case: str, results: list[dict]) -> float:
    """``check_continuation`` against ``expected_after``, every param within TOL."""
    return check_continuation(case, results, want=expected_after(case), noisy=())


NO_OFFLOAD = ["zero_optimization.offload_optimizer.device=none", "moe.ep_size=1"]


@pytest.mark.parametrize("case", CASES)
def test_w1_continues_the_deepspeed_run_at_stages_0_2_3(imported, case):
    for stage in (0, 2, 3):
        check(case, [continue_one_step(str(imported / case),
                                       [f"zero_optimization.stage={stage}", *NO_OFFLOAD],
                                       batch(case))])


def _continue_all(root: str, cases: tuple[str, ...]) -> list[dict]:
    """Every case's step on this rank, W = 2, ep 2, ZeRO-3 (one spawn of the world)."""
    return [continue_one_step(f"{root}/{case}", ["moe.ep_size=2", "zero_optimization.stage=3"],
                              batch(case)) for case in cases]


@pytest.mark.slow  # one spawn of W = 2 for the three cases: ~50 s on a loaded 2-core box
def test_w2_ep2_stage3_continues_the_deepspeed_runs(imported, tmp_path):
    per_rank = run_world(_continue_all, 2, tmp_path, str(imported), CASES, timeout_s=240)
    for i, case in enumerate(CASES):
        check(case, [r[i] for r in per_rank])


# ---------------------------------------------------------------------------- refusals
def _narrower_config(ckpt, tmp) -> str:
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "intermediate_size": 8}))
    return f"{ckpt / 'global_step2' / 'mp_rank_00_model_states.pt'}: DeepSpeed param " \
        "model.layers.0.mlp.experts.gate_up_proj_bias [4, 32]: config.json implies [4, 16]"


def _no_correction_bias(ckpt, tmp) -> str:
    path = ckpt / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    del state["module"]["model.layers.1.mlp.gate.e_score_correction_bias"]
    torch.save(state, path)
    return f"{path}: buffer model.layers.1.mlp.gate.e_score_correction_bias absent; moezero's " \
        "layers.1.moe.router.expert_bias needs [8]"


def _no_router_bias(ckpt, tmp) -> str:
    """A gpt-oss run whose model states list no router bias (its optimizer files unchanged)."""
    path = ckpt / "global_step2" / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    state["param_shapes"] = [{("model.layers.1.mlp.router.extra" if k ==
                               "model.layers.1.mlp.router.bias" else k): v for k, v in g.items()}
                             for g in state["param_shapes"]]
    torch.save(state, path)
    return "no parameter for layers.1.moe.router.bias (looked for " \
        "model.layers.1.mlp.router.bias or "


FAULTS = {"narrower_config": ("gpt_oss_z2_w2", _narrower_config),
          "no_router_bias": ("gpt_oss_z2_w2", _no_router_bias),
          "no_correction_bias": ("deepseek_v3_z3_w2", _no_correction_bias)}


@pytest.mark.parametrize("fault", FAULTS)
def test_what_cannot_be_placed_is_one_line_and_nothing_written(tmp_path, capsys, fault):
    from moezero.cli import main

    case, make = FAULTS[fault]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / case / "ckpt", ckpt)
    expected = make(ckpt, tmp_path)
    code = main(["import-deepspeed", str(ckpt), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("moezero: error: ") and expected in err[0], err[0]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ gpt-oss experts per expert
_PER_EXPERT = {  # fused tensor -> [(per-expert name, its part of expert e's slice)]
    "gate_up_proj": [("gate_proj.weight", lambda w: w[:, 0::2].t()),
                     ("up_proj.weight", lambda w: w[:, 1::2].t())],
    "gate_up_proj_bias": [("gate_proj.bias", lambda w: w[0::2]),
                          ("up_proj.bias", lambda w: w[1::2])],
    "down_proj": [("down_proj.weight", lambda w: w.t())],
    "down_proj_bias": [("down_proj.bias", lambda w: w)]}


def _per_expert_params(shapes: dict, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """DeepSpeed's flat group ``flat`` (params of ``shapes`` in order) with gpt-oss's fused
    experts re-saved as one [out, in] param per expert, as a model of per-expert modules has."""
    out, at = {}, 0
    for name, shape in shapes.items():
        t = flat[at:at + shape.numel()].reshape(shape)
        at += shape.numel()
        prefix, _, leaf = name.rpartition(".")
        if leaf not in _PER_EXPERT:
            out[name] = t
            continue
        for e, w in enumerate(t):
            out.update({f"{prefix}.{e}.{n}": part(w).contiguous() for n, part in _PER_EXPERT[leaf]})
    return out


def _resave_per_expert(ckpt) -> None:
    """The gpt-oss fixture's state (masters and moments of its one ZeRO-2 group, W = 2) as a run
    of a model with per-expert modules would have saved it."""
    from tests.torch_impl.test_deepspeed_import import _edit_rank

    tag = ckpt / "global_step2"
    model = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
    shapes = dict(model["param_shapes"][0])
    files = [tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]
    tops = [{} for _ in files]
    for path, top in zip(files, tops, strict=True):
        _edit_rank(path, lambda obj, t, top=top: top.update(t=t))
    get = {"master": lambda t: t["single_partition_of_fp32_groups"],
           "exp_avg": lambda t: [t["base_optimizer_state"]["state"][0]["exp_avg"]],
           "exp_avg_sq": lambda t: [t["base_optimizer_state"]["state"][0]["exp_avg_sq"]]}
    new = {}
    for state, read in get.items():
        parts = [read(top["t"])[0] for top in tops]
        params = _per_expert_params(shapes, torch.cat(parts))
        flat = torch.cat([t.reshape(-1) for t in params.values()])
        new[state] = list(torch.cat([flat, torch.zeros(sum(map(len, parts)) - len(flat))])
                          .split(len(parts[0])))
    for r, path in enumerate(files):
        def edit(obj, top, r=r):
            top["single_partition_of_fp32_groups"] = [new["master"][r].clone()]
            top["base_optimizer_state"]["state"][0].update(
                exp_avg=new["exp_avg"][r].clone(), exp_avg_sq=new["exp_avg_sq"][r].clone())
        _edit_rank(path, edit)
    model["param_shapes"] = [{k: v.shape for k, v in params.items()}]
    torch.save(model, tag / "mp_rank_00_model_states.pt")


def test_gpt_oss_experts_saved_per_expert_are_copied_not_relaid(tmp_path):
    """Per-expert [out, in] params (weights by the Hugging Face names, biases by ``--names``)
    are moezero's order already: the import equals DeepSpeed's state exactly (the fused-layout
    rewrite once ran on them too)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "gpt_oss_z2_w2" / "ckpt", ckpt)
    _resave_per_expert(ckpt)
    names = tmp_path / "names.yaml"
    names.write_text("".join(f"'model.layers.{{L}}.mlp.experts.{{E}}.{hf}.bias': "
                             f"'layers.{{L}}.moe.experts.{{E}}.{w}.bias'\n" for hf, w in
                             (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))))
    import_deepspeed(ckpt, tmp_path / "out", names=names)
    step_dir = store.find_checkpoint(tmp_path / "out")
    manifest = store.read_manifest(step_dir)
    for state in STATES:
        want = expected_state("gpt_oss_z2_w2", state)
        for fqn, _ in manifest.layout.shapes:
            got = store.read_param(step_dir, manifest, fqn, state=state)
            assert torch.equal(torch.from_numpy(got), want[fqn].reshape(-1)), (state, fqn)
