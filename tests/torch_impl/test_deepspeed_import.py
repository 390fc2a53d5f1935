"""``moezero import-deepspeed`` against checkpoints the real DeepSpeed 0.19.8 wrote
(tests/fixtures/deepspeed/, made by its make_fixtures.py in DeepSpeed's own venv).

The continuation test: DeepSpeed ran K steps, saved, and ran step K+1 (loss L, parameters P,
recorded in the fixture). moezero imports the step-K checkpoint and runs step K+1 on the same
global batch, at another world size / ep / ZeRO stage: loss == L and parameters == P within
fp32 tolerance; the control (Adam moments dropped) lands far outside it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moezero.checkpoint.deepspeed import import_deepspeed
from moezero.config import load_config
from moezero.plan import store
from moezero.train import setup
from tests.support.compare import max_abs, rel_err
from tests.support.world import run_world

FIXTURES = Path(os.environ.get("MOEZERO_DS_FIXTURES")  # nox -s deepspeed_fixtures: made anew
                or Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed")
CASES = ("mixtral_z1_w1", "mixtral_z2_w2", "mixtral_z3_w2", "mixtral_z3_w3", "mixtral_z2_w2_cpu",
         "qwen3_moe_z2_w2", "qwen2_moe_z2_w2", "qwen2_moe_z3_w2", "olmoe_z2_w2",
         "native_moe_z2_w2_ep2", "native_moe_z2_w4_ep2", "native_moe_z0_w2_ep2")
NVME = "mixtral_z3_w2_nvme"  # ~12 MB, not committed: made by nox -s deepspeed_fixtures
# Not committed either (the committed fixtures stay under ~9 MB); made by the nox session:
# native MoE at ZeRO-1 (the ZeRO-2 format), a dense-group-only run without ZeRO (its optimizer
# state in the model-states file). Their tests skip visibly without them.
EXTRA = (NVME, "native_moe_z1_w2_ep2", "mixtral_z0_w1")
MADE = tuple(c for c in EXTRA if (FIXTURES / c).is_dir())
LOCAL = [*CASES, *(pytest.param(c, marks=pytest.mark.skipif(
    c not in MADE, reason="fixture not committed (nox -s deepspeed_fixtures makes it)"))
    for c in EXTRA)]
TOL = 1e-6  # the bound: fp32, relative
# Qwen2-MoE's k-projection bias adds q.b_k to every score of a query: softmax ignores it, so its
# true gradient is 0 and each framework's is rounding noise (~1e-9) that Adam (eps 1e-8) turns
# into a step of up to ~lr. The two runs' noise differs, so the bias is held to an absolute
# bound: its step-(K+1) update agrees to within 1e-3 lr (measured 1.7e-4 lr; the moments
# dropped, it moves by ~lr). Every other param: TOL.
NOISE_ONLY = 1e-3


def expected_native(case: str) -> dict[str, torch.Tensor]:
    """The same for the native-MoE case (a Qwen3-MoE decoder whose blocks are DeepSpeed's
    ``MoE``; the fixture names experts by their global index, as DeepSpeed's expert files)."""
    after = load_file(FIXTURES / case / "after.safetensors")
    out = {"embed.weight": after.pop("model.embed_tokens.weight"),
           "norm.weight": after.pop("model.norm.weight"),
           "lm_head.weight": after.pop("lm_head.weight")}
    block = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_norm.weight": "attn.q_norm.weight",
             "self_attn.k_norm.weight": "attn.k_norm.weight",
             "mlp.moe.deepspeed_moe.gate.wg.weight": "moe.router.weight",
             **{f"self_attn.{x}_proj.weight": f"attn.w{x}.weight" for x in "qkvo"}}
    expert = "mlp.moe.deepspeed_moe.experts.deepspeed_experts."
    for key in sorted(after):
        layer, rest = key.removeprefix("model.layers.").split(".", 1)
        if rest.startswith(expert):
            e, w = rest.removeprefix(expert).split(".")[:2]
            out[f"layers.{layer}.moe.experts.{e}.{w}.weight"] = after[key]
        else:
            out[f"layers.{layer}.{block[rest]}"] = after[key]
    return out


def expected_params(case: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's parameters after step K+1 under moezero's FQNs, mapped here by hand from
    transformers 5's names of the HF families (fused experts: gate_up_proj [E, 2F, D], down_proj
    [E, D, F])."""
    if case.startswith("native"):
        return expected_native(case)
    config = json.loads((FIXTURES / case / "ckpt" / "config.json").read_text())
    ffn = config.get("moe_intermediate_size") or config["intermediate_size"]
    after = load_file(FIXTURES / case / "after.safetensors")
    out = {"embed.weight": after.pop("model.embed_tokens.weight"),
           "norm.weight": after.pop("model.norm.weight"),
           "lm_head.weight": after.pop("lm_head.weight")}
    block = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate.weight": "moe.router.weight",
             "self_attn.q_norm.weight": "attn.q_norm.weight",  # Qwen3-MoE, OLMoE
             "self_attn.k_norm.weight": "attn.k_norm.weight",
             "mlp.shared_expert.gate_proj.weight": "shared.w1.weight",  # Qwen2-MoE
             "mlp.shared_expert.up_proj.weight": "shared.w3.weight",
             "mlp.shared_expert.down_proj.weight": "shared.w2.weight",
             "mlp.shared_expert_gate.weight": "shared.gate.weight",
             **{f"self_attn.{x}_proj.bias": f"attn.w{x}.bias" for x in "qkv"},
             **{f"self_attn.{x}_proj.weight": f"attn.w{x}.weight" for x in "qkvo"}}
    for key in sorted(after):
        layer, rest = key.removeprefix("model.layers.").split(".", 1)
        if rest in block:
            out[f"layers.{layer}.{block[rest]}"] = after[key]
        elif rest == "mlp.experts.gate_up_proj":
            for e, w in enumerate(after[key]):
                out[f"layers.{layer}.moe.experts.{e}.w1.weight"] = w[:ffn]
                out[f"layers.{layer}.moe.experts.{e}.w3.weight"] = w[ffn:]
        else:
            assert rest == "mlp.experts.down_proj", key
            for e, w in enumerate(after[key]):
                out[f"layers.{layer}.moe.experts.{e}.w2.weight"] = w
    return out


def continue_one_step(ckpt: str, overrides: list[str], tokens: torch.Tensor,
                      drop_moments: bool = False) -> dict:
    """Load the imported checkpoint, run one step on this rank's rows of ``tokens``."""
    cfg = load_config(Path(ckpt) / "config.yaml", overrides)
    engine, _ = setup(cfg, torch.device("cpu"))
    engine.load_checkpoint(ckpt)
    start = engine.step_count
    if drop_moments:
        for shard in engine.optimizer.shards():
            for key, t in shard.tensors.items():
                if key != "master":
                    t.zero_()
    rows = tokens.shape[0] // engine.topology.world_size
    mine = tokens[engine.topology.rank * rows:(engine.topology.rank + 1) * rows]
    metrics = engine.train_step([mine])
    loss = metrics["loss"]
    return {"start": start, "loss": loss, "lrs": [metrics["lr"], engine.current_lr()],
            "params": {k: p.detach().float().clone()
                       for k, p in engine.full_parameters().items()}}


def check_continuation(case: str, results: list[dict], tol: float = TOL,
                       want: dict[str, torch.Tensor] | None = None,
                       noisy: tuple[str, ...] = (".attn.wk.bias",)) -> float:
    """The ranks' ``results`` of one step after the import against DeepSpeed's: loss and every
    parameter (``want``, default ``expected_params``) within ``tol``; the params ending in
    ``noisy``, whose gradient is rounding noise here, within ``NOISE_ONLY`` lr."""
    ref = json.loads((FIXTURES / case / "reference.json").read_text())
    assert results[0]["start"] == ref["k"]
    assert rel_err(results[0]["loss"], ref["loss"]) <= tol, (results[0]["loss"], ref["loss"])
    got = {k: v for r in results for k, v in r["params"].items()}
    want = expected_params(case) if want is None else want
    assert set(got) == set(want)
    noise = [k for k in want if k.endswith(noisy)]
    for k in noise:  # the k bias's gradient is rounding noise: see NOISE_ONLY
        assert max_abs(got[k], want[k]) <= NOISE_ONLY * ref["lr"], (k, max_abs(got[k], want[k]))
    worst = max(rel_err(got[k], want[k]) for k in want if k not in noise)
    print(f"{case}: loss rel err {rel_err(results[0]['loss'], ref['loss']):.2e}, "
          f"worst param rel err {worst:.2e}")
    assert worst <= tol, worst
    return worst


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    for case in CASES + MADE:
        import_deepspeed(FIXTURES / case / "ckpt", root / case)
    return root


def batch(case: str) -> torch.Tensor:
    return load_file(FIXTURES / case / "batch.safetensors")["tokens"]


NO_OFFLOAD = ["zero_optimization.offload_optimizer.device=none",
              "zero_optimization.offload_param.device=none"]  # the config keeps the source's


@pytest.mark.parametrize("case", LOCAL)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_w1_continues_the_deepspeed_run(imported, case, stage):
    result = continue_one_step(str(imported / case), ["moe.ep_size=1",
                               f"zero_optimization.stage={stage}", *NO_OFFLOAD], batch(case))
    check_continuation(case, [result])


def test_control_without_adam_moments_is_far_off(imported):
    case = "mixtral_z2_w2"
    result = continue_one_step(str(imported / case), ["moe.ep_size=1"], batch(case),
                               drop_moments=True)
    with pytest.raises(AssertionError):
        check_continuation(case, [result])
    want = expected_params(case)
    worst = max(rel_err(result["params"][k], want[k]) for k in want)
    assert worst > 1e3 * TOL, worst


W2 = {"stage2": ["zero_optimization.stage=2"],
      "stage3_cpu_offload": ["zero_optimization.stage=3",
                             "zero_optimization.offload_optimizer.device=cpu"]}


@pytest.mark.parametrize("case,layout", [("mixtral_z3_w2", "stage2"),
                                         ("mixtral_z2_w2", "stage3_cpu_offload"),
                                         ("native_moe_z2_w2_ep2", "stage2"),
                                         ("native_moe_z2_w4_ep2", "stage3_cpu_offload"),
                                         *(pytest.param(*c, marks=pytest.mark.slow) for c in (
                                             ("qwen2_moe_z3_w2", "stage2"),
                                             ("olmoe_z2_w2", "stage3_cpu_offload"),
                                             ("native_moe_z0_w2_ep2", "stage2")))])
def test_w2_ep2_continues_the_deepspeed_run(imported, tmp_path, case, layout):
    results = run_world(continue_one_step, 2, tmp_path, str(imported / case),
                        ["moe.ep_size=2", *W2[layout]], batch(case), timeout_s=180)
    check_continuation(case, results)


def test_import_records_the_deepspeed_counters_and_settings(imported):
    manifest = store.read_manifest(store.find_checkpoint(imported / "mixtral_z2_w2"))
    assert manifest.step == 2 and not manifest.layout.weights_only
    assert manifest.state["engine"]["step_count"] == 2
    assert manifest.state["engine"]["global_steps"] == 2
    cfg = load_config(imported / "mixtral_z2_w2" / "config.yaml")
    opt = cfg.optimizer
    assert (opt.lr, tuple(opt.betas), opt.eps, opt.weight_decay) == (1e-2, (0.9, 0.95), 1e-8, 0.1)
    assert (opt.warmup_steps, opt.min_lr_ratio, opt.max_grad_norm) == (0, 1.0, None)
    assert not opt.no_decay_on_norms and cfg.precision.dtype == "fp32"
    assert store.verify(store.find_checkpoint(imported / "mixtral_z2_w2")) == []


KEPT = {"mixtral_z1_w1": (1, "none", 1), "mixtral_z2_w2": (2, "none", 1),
        "mixtral_z3_w2": (3, "none", 1), "mixtral_z2_w2_cpu": (2, "cpu", 1),
        "native_moe_z2_w2_ep2": (2, "none", 2), "native_moe_z0_w2_ep2": (0, "none", 2)}


@pytest.mark.parametrize("case", KEPT)
def test_the_written_config_keeps_the_sources_stage_offload_and_ep(imported, case):
    """issue 38 #3: config.yaml runs as DeepSpeed ran (ZeRO stage, optimizer offload, ep: no
    ep_size 2 for a run without expert parallelism)."""
    cfg = load_config(imported / case / "config.yaml")
    zero = cfg.zero_optimization
    assert (zero.stage, zero.offload_optimizer.device, cfg.moe.ep_size) == KEPT[case]


def _warmup_lr_run(ckpt: Path, scheduler: dict, last_batch_iteration: int, lr: float) -> None:
    """The fixture's run as DeepSpeed saves it with ``scheduler`` in its ds_config: the
    scheduler's state in the model states, every rank's param group at the scheduled ``lr``."""
    tag = ckpt / "global_step2"
    path = tag / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    config = {**state["ds_config"], "scheduler": scheduler}
    state.update(ds_config=config, lr_scheduler={"last_batch_iteration": last_batch_iteration})
    torch.save(state, path)

    def scheduled(obj, top):
        obj["ds_config"] = config
        groups = top["base_optimizer_state"]["param_groups"]
        top["base_optimizer_state"]["param_groups"] = [{**g, "lr": lr} for g in groups]
    for rank in (0, 1):
        _edit_rank(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", scheduled)


def deepspeed_warmup_lr(iteration: int, *, warmup_min_lr: float, warmup_max_lr: float,
                        warmup_num_steps: int) -> float:
    """DeepSpeed's documented WarmupLR (log warmup, its default): from warmup_min_lr to
    warmup_max_lr as log(iteration + 1) / log(warmup_num_steps), then warmup_max_lr. The
    scheduler steps after each optimizer step, so optimizer step s (1-based) runs at iteration
    s - 2 (the first two at warmup_min_lr)."""
    if iteration >= warmup_num_steps:
        return warmup_max_lr
    gamma = math.log(max(iteration, 0) + 1) / math.log(warmup_num_steps)
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def test_a_run_stopped_mid_warmup_continues_at_deepspeeds_lr(tmp_path):
    """issue 38 #3: a WarmupLR run stopped after 2 steps of 10 in warmup: the import carries
    the schedule (not the current lr as a constant), and moezero's steps 3 and 4 run at the lr
    DeepSpeed would have used."""
    import shutil

    from tests.torch_impl.test_cli import moezero

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "mixtral_z2_w2" / "ckpt", ckpt)
    params = {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}
    _warmup_lr_run(ckpt, {"type": "WarmupLR", "params": params}, 1,
                   deepspeed_warmup_lr(1, **params))
    import_deepspeed(ckpt, tmp_path / "imported")
    cfg = load_config(tmp_path / "imported" / "config.yaml")
    assert cfg.optimizer.lr == params["warmup_max_lr"]
    res = moezero("train", "--nproc", "1", "--config", str(tmp_path / "imported" / "config.yaml"),
                  "--set", "train.steps=4", "--set", "train.seq_len=12",
                  "--out", str(tmp_path / "run"), timeout=240)
    assert res.returncode == 0, res.stderr
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == [3, 4]
    for m in metrics:
        want = deepspeed_warmup_lr(m["step"] - 2, **params)
        assert abs(m["lr"] - want) <= 1e-12 * want, (m["step"], m["lr"], want)


WARMUP_CASE = "mixtral_z2_w2_warmup"


def test_a_deepspeed_warmup_lr_run_continues_at_deepspeeds_own_lr(tmp_path):
    """issue 38 #3 against the real DeepSpeed: a ``WarmupLR`` run (log warmup 1e-5 -> 1e-3 over
    10 steps) saved after 2 steps, still warming up, imported with ``moezero import-deepspeed``.
    moezero's step 3 runs at the lr DeepSpeed's engine used for its step 3 and its step 4 at
    the one DeepSpeed would use (both recorded by the fixture from ``engine.get_lr()``, not
    computed from a formula), in the engine and in ``moezero train``; step 3 lands on
    DeepSpeed's loss and parameters."""
    from moezero.cli import main
    from tests.torch_impl.test_cli import moezero

    ref = json.loads((FIXTURES / WARMUP_CASE / "reference.json").read_text())
    assert main(["import-deepspeed", str(FIXTURES / WARMUP_CASE / "ckpt"),
                 "--out", str(tmp_path / "imported")]) == 0
    cfg = load_config(tmp_path / "imported" / "config.yaml")
    assert cfg.optimizer.lr == ref["scheduler"]["params"]["warmup_max_lr"]
    result = continue_one_step(str(tmp_path / "imported"), ["moe.ep_size=1"],
                               batch(WARMUP_CASE))
    want = ref["lrs"][ref["k"]:ref["k"] + 2]
    assert want[0] < want[1] < ref["scheduler"]["params"]["warmup_max_lr"]  # mid-warmup
    for got, lr in zip(result["lrs"], want, strict=True):
        assert abs(got - lr) <= 1e-12 * lr, (result["lrs"], want)
    check_continuation(WARMUP_CASE, [result])
    res = moezero("train", "--nproc", "1", "--config", str(tmp_path / "imported" / "config.yaml"),
                  "--set", "train.steps=4", "--set", "train.seq_len=12",
                  "--out", str(tmp_path / "run"), timeout=240)
    assert res.returncode == 0, res.stderr
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == [3, 4]
    for m, lr in zip(metrics, want, strict=True):  # moezero train: DeepSpeed's lrs too
        assert abs(m["lr"] - lr) <= 1e-12 * lr, (m["step"], m["lr"], lr)


# ---------------------------------------------------------------------------- refusals
class _Payload:
    """Pickles as a call of ``os.system``: loading it with plain pickle would run a command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


def _forbidden_global(folder: Path, tmp: Path) -> str:
    path = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"x": _Payload(tmp / "pwned")}}, path)
    return "refusing to load: the pickle asks for posix.system"


def _truncated(folder: Path, tmp: Path) -> str:
    path = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "zero_pp_rank_1_mp_rank_00_optim_states.pt: not a readable torch checkpoint"


def _missing_rank(folder: Path, tmp: Path) -> str:
    (folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    return "missing the optimizer file of rank 1 (dp_world_size=2; found 1)"


def _partition_of_another_world(folder: Path, tmp: Path) -> str:
    w1 = FIXTURES / "mixtral_z1_w1" / "ckpt" / "global_step2"
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    (folder / name).write_bytes((w1 / name).read_bytes())
    return f"{name}: partition of [21920] elements, a world of 2 ranks needs [10960] " \
           "(world-size mismatch)"


def _extra_rank(folder: Path, tmp: Path) -> str:
    src = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (folder / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(src.read_bytes())
    return "rank 2 beyond dp_world_size=2 recorded in the model states (world-size mismatch)"


def _no_config_json(folder: Path, tmp: Path) -> str:
    (folder.parent / "config.json").unlink()
    return "no config.json here or one folder up"


def _edit_rank(path: Path, edit) -> None:
    """Rewrite an optimizer file with ``edit(obj, optimizer_state_dict)`` applied. DeepSpeed's
    own objects cannot be pickled back under their names here: the loss scaler (rank 0's is
    the one read) and the slice mappings (not read) are dropped, the stage is a plain int."""
    from moezero.checkpoint.deepspeed import pickles

    obj = {k: v for k, v in pickles.load(path).items()}
    top = dict(obj["optimizer_state_dict"])
    top.pop("param_slice_mappings", None)
    top["loss_scaler"], top["zero_stage"] = None, int(top["zero_stage"])
    top["base_optimizer_state"] = {**top["base_optimizer_state"]}
    edit(obj, top)
    new = path.with_name(path.name + ".new")  # the old file stays mapped until replaced
    torch.save({**obj, "optimizer_state_dict": top}, new)
    os.replace(new, path)


RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _rank_of_an_earlier_step(folder: Path, tmp: Path) -> str:
    """issue 38 #2: rank 1's file of the save one step earlier (same size)."""
    def earlier(obj, top):
        state = top["base_optimizer_state"]["state"]
        top["base_optimizer_state"]["state"] = {g: {**e, "step": e["step"] - 1}
                                                for g, e in state.items()}
    _edit_rank(folder / RANK1, earlier)
    return f"{RANK1}: Adam step 1, rank 0's file says 2 (rank files of different saves)"


def _rank_of_a_bf16_run(folder: Path, tmp: Path) -> str:
    def bf16(obj, top):
        obj["ds_config"] = {**obj["ds_config"], "bf16": {"enabled": True}}
    _edit_rank(folder / RANK1, bf16)
    return f"{RANK1}: ds_config differs from the model states' (at 'bf16'): a file of " \
        "another run"


def _rank_of_another_version(folder: Path, tmp: Path) -> str:
    def older(obj, top):
        obj["ds_version"] = "0.18.0"
    _edit_rank(folder / RANK1, older)
    return f"{RANK1}: ds_version 0.18.0, the model states say 0.19.8: a file of another run"


def _rank_of_another_partition_count(folder: Path, tmp: Path) -> str:
    def count(obj, top):
        top["partition_count"] = [4]
    _edit_rank(folder / RANK1, count)
    return f"{RANK1}: partition_count [4], a world of 2 ranks gives [2]"


FAULTS = {"forbidden_global": _forbidden_global, "truncated": _truncated,
          "no_config_json": _no_config_json,
          "missing_rank": _missing_rank, "partition_of_another_world":
          _partition_of_another_world, "extra_rank": _extra_rank,
          "rank_of_an_earlier_step": _rank_of_an_earlier_step,
          "rank_of_a_bf16_run": _rank_of_a_bf16_run,
          "rank_of_another_version": _rank_of_another_version,
          "rank_of_another_partition_count": _rank_of_another_partition_count}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_bad_checkpoint_is_one_line_and_nothing_written(tmp_path, capsys, fault):
    import shutil

    from moezero.cli import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "mixtral_z2_w2" / "ckpt", ckpt)
    expected = FAULTS[fault](ckpt / "global_step2", tmp_path)
    code = main(["import-deepspeed", str(ckpt), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("moezero: error: ") and expected in err[0], err[0]
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "pwned").exists()


def test_an_out_holding_a_killed_imports_partial_is_named(tmp_path, capsys):
    """issue 38 #12: re-importing into an --out that holds a killed import's step directory
    names it, not just 'not an empty directory'."""
    from moezero.cli import main

    (tmp_path / "out" / "step_00000002.partial").mkdir(parents=True)
    code = main(["import-deepspeed", str(FIXTURES / "mixtral_z2_w2" / "ckpt"),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"--out {tmp_path / 'out'}: exists and is not an empty directory: it holds " \
        "step_00000002.partial, left by a killed import or export; remove it" in err[0], err[0]


def test_ctrl_c_during_an_import_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """issue 38 #11: Ctrl-C while the rank files are copied printed a 25-line traceback; now
    one line, exit 130, and no --out left."""
    from moezero.checkpoint.deepspeed import importer
    from moezero.cli import main

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(importer, "_write_rank", interrupted)
    code = main(["import-deepspeed", str(FIXTURES / "mixtral_z2_w2" / "ckpt"),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and len(err) == 1, err
    assert err[0] == f"moezero: interrupted: import-deepspeed stopped; nothing was kept in " \
        f"{tmp_path / 'out'}", err[0]
    assert not (tmp_path / "out").exists()


def test_every_rank_file_of_another_step_than_the_model_states_is_noted(tmp_path, capsys):
    """Every rank file at Adam step 2 in a tag folder whose model states say step 3: imported
    (DeepSpeed's ``load_optimizer_states=False`` resets Adam's step in a real run), noted."""
    import shutil

    from moezero.cli import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "mixtral_z2_w2" / "ckpt", ckpt)
    path = ckpt / "global_step2" / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    state["global_steps"] = 3
    torch.save(state, path)
    assert main(["import-deepspeed", str(ckpt), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "Adam step 2, but the model states say global_steps 3 (0 skipped)" in out, out


def _rewrite(path: Path, edit) -> None:
    state = torch.load(path, weights_only=True)
    edit(state["optimizer"]["param_groups"])
    torch.save(state, path)


def _two_dense_groups(folder: Path) -> str:
    def split(groups):
        dense = groups[0]
        groups.insert(1, {**dense, "name": "no_decay", "params": dense["params"][10:]})
        dense["params"] = dense["params"][:10]
    _rewrite(folder / "mp_rank_00_model_states.pt", split)
    return "mp_rank_00_model_states.pt: ZeRO stage 0 with 2 dense and 1 expert param groups: " \
        "the order of the params is only known for one dense group"


def _params_out_of_order(folder: Path) -> str:
    def swap(groups):  # embed [48, 32] and q_proj [32, 32] trade places on rank 1
        groups[0]["params"][:2] = groups[0]["params"][1::-1]
    _rewrite(folder / "expp_rank_1_mp_rank_00_optim_states.pt", swap)
    return "expp_rank_1_mp_rank_00_optim_states.pt: param 1 exp_avg is torch.float32 [32, 32], " \
        "model.embed_tokens.weight is float32 [48, 32]: the order of the params cannot be " \
        "established"


def _missing_expp_rank(folder: Path) -> str:
    (folder / "expp_rank_0_mp_rank_00_optim_states.pt").unlink()
    return "missing expp_rank_0_mp_rank_00_optim_states.pt (found 1 expert-parallel optimizer " \
        "files)"


def _group_of_another_size(folder: Path) -> str:
    def drop(groups):
        groups[1]["params"] = groups[1]["params"][:-1]
    _rewrite(folder / "mp_rank_00_model_states.pt", drop)
    return "optimizer group 'ep_size_2' has 11 params, the expert files 12: the order of the " \
        "params cannot be established"


def _bf16_module(folder: Path) -> str:
    path = folder / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    state["module"] = {k: v.bfloat16() for k, v in state["module"].items()}
    torch.save(state, path)
    return "mp_rank_00_model_states.pt: ZeRO stage 0 with a bfloat16 module: only fp32 runs " \
        "(whose module weights are the masters) are imported"


STAGE0_FAULTS = {"two_dense_groups": _two_dense_groups, "bf16_module": _bf16_module,
                 "params_out_of_order": _params_out_of_order,
                 "missing_expp_rank": _missing_expp_rank,
                 "group_of_another_size": _group_of_another_size}


@pytest.mark.parametrize("fault", STAGE0_FAULTS)
def test_a_stage0_checkpoint_that_cannot_be_placed_is_one_line(tmp_path, capsys, fault):
    """Without ZeRO the moments are keyed by param index: the names come from the order of
    ``param_groups``; where that order does not fit the model, refuse."""
    import shutil

    from moezero.cli import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "native_moe_z0_w2_ep2" / "ckpt", ckpt)
    expected = STAGE0_FAULTS[fault](ckpt / "global_step2")
    code = main(["import-deepspeed", str(ckpt), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("moezero: error: ") and expected in err[0], err[0]
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- memory
BIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
           num_attention_heads=4, num_key_value_heads=4, num_local_experts=8,
           num_experts_per_tok=2, model_type="mixtral", tie_word_embeddings=False,
           rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64)


def big_shapes() -> dict[str, tuple[int, ...]]:
    """transformers 5 Mixtral's parameters (fused experts) for ``BIG``."""
    d, f, e, v = (BIG[k] for k in ("hidden_size", "intermediate_size", "num_local_experts",
                                   "vocab_size"))
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(BIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + f"self_attn.{x}_proj.weight": (d, d) for x in "qkvo"})
        shapes.update({p + "mlp.gate.weight": (e, d), p + "mlp.experts.gate_up_proj": (e, 2 * f, d),
                       p + "mlp.experts.down_proj": (e, d, f), p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
    shapes.update({"model.norm.weight": (d,), "lm_head.weight": (v, d)})
    return shapes


def write_zero2_like(folder: Path, world: int) -> int:
    """A ZeRO-2 checkpoint in DeepSpeed 0.19's file layout (the entries the importer reads;
    the real format is covered by the fixtures above), W ``world``, two param groups (experts
    apart, as DeepSpeed's MoE param split makes them); returns the param count."""
    from collections import OrderedDict

    shapes = big_shapes()
    groups = [OrderedDict((k, torch.Size(s)) for k, s in shapes.items() if ("experts" in k) == e)
              for e in (False, True)]
    tag = folder / "global_step3"
    tag.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(BIG))
    config = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}
    torch.save({"module": {}, "param_shapes": groups, "dp_world_size": world,
                "mp_world_size": 1, "global_steps": 3, "ds_config": config,
                "ds_version": "0.19.8"}, tag / "mp_rank_00_model_states.pt")
    pers = [-(-sum(s.numel() for s in g.values()) // (2 * world)) * 2 for g in groups]
    gen = torch.Generator().manual_seed(0)
    for r in range(world):
        flat = [[torch.randn(per, generator=gen) for per in pers] for _ in range(3)]
        group = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
        state = {g: {"step": torch.tensor(3.0), "exp_avg": flat[1][g], "exp_avg_sq": flat[2][g]}
                 for g in range(2)}
        torch.save({"optimizer_state_dict": {
            "zero_stage": 2, "loss_scaler": None, "single_partition_of_fp32_groups": flat[0],
            "base_optimizer_state": {"state": state, "param_groups": [group, dict(group)]}}},
                   tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    return sum(torch.Size(s).numel() for s in shapes.values())


PEAK = """
import sys
from pathlib import Path
from moezero.checkpoint.deepspeed import import_deepspeed
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import_deepspeed(sys.argv[3], sys.argv[4])  # a tiny import first: every module loaded
Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current RSS
before = rss("VmRSS:")
import_deepspeed(sys.argv[1], sys.argv[2])
print(before, rss("VmHWM:"))
"""


def test_peak_rss_of_an_import_stays_under_a_budget_smaller_than_the_model(tmp_path):
    """21 M params (81 MiB of fp32 weights, 243 MiB of optimizer state) in 4 rank files of two
    groups each: the import holds about one rank file at a time, and copies no group."""
    import subprocess
    import sys

    world = 4
    numel = write_zero2_like(tmp_path / "ds", world)
    model_bytes = numel * 4  # the fp32 weights alone (the state is 3x that)
    res = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "ds"), str(tmp_path / "out"),
                          str(FIXTURES / "mixtral_z1_w1" / "ckpt"), str(tmp_path / "warm")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    before, peak = map(int, res.stdout.split())
    rank_file = 3 * numel * 4 / world
    budget = rank_file + 16 * 2**20  # one DeepSpeed file and a little
    print(f"model {model_bytes / 2**20:.1f} MiB, rank file {rank_file / 2**20:.1f} MiB, "
          f"import grew RSS by {(peak - before) / 2**20:.1f} MiB (budget {budget / 2**20:.1f})")
    assert budget < model_bytes
    assert peak - before < budget
    assert store.verify(store.find_checkpoint(tmp_path / "out")) == []


# ---------------------------------------------------------------------------- native MoE names
def test_name_patterns_map_layers_and_global_experts(tmp_path):
    from moezero.checkpoint.deepspeed import patterns

    names = tmp_path / "names.yaml"
    names.write_text("'blocks.{L}.ffn.*experts.{E}.fc_in.weight': 'layers.{L}.moe.experts.{E}"
                     ".w1.weight'\n")
    got = patterns.by_fqn(["blocks.3.ffn.deepspeed_moe.experts.deepspeed_experts.5.fc_in.weight",
                           "model.layers.1.mlp.moe.deepspeed_moe.gate.wg.weight",
                           "model.layers.0.self_attn.q_proj.weight"], patterns.load(names))
    assert got == {"layers.3.moe.experts.5.w1.weight":
                   "blocks.3.ffn.deepspeed_moe.experts.deepspeed_experts.5.fc_in.weight",
                   "layers.1.moe.router.weight":
                   "model.layers.1.mlp.moe.deepspeed_moe.gate.wg.weight"}


def test_the_report_names_the_layout_and_measures_the_expert_files(tmp_path, capsys):
    from moezero.cli import main

    code = main(["import-deepspeed", str(FIXTURES / "native_moe_z2_w2_ep2" / "ckpt"), "--out",
                 str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ZeRO stage 2, data-parallel world size 2, ep 2, module dtype float32, 21,952 " \
           "parameters in 2 optimizer group(s)" in out
    held = 8 * 3 * 16 * 32 * 4  # 2 layers x 4 experts, three 16x32 fp32 matrices each
    assert f"expert files: 8, {sum(p.stat().st_size for p in (FIXTURES / 'native_moe_z2_w2_ep2' / 'ckpt' / 'global_step2').glob('layer_*')):,} bytes holding {held:,} bytes" in out
    assert "fp32 master, exp_avg, exp_avg_sq, Adam step 2, static loss scale" in out


def test_a_pad_token_the_embedding_does_not_train_is_reported(tmp_path, capsys):
    """OLMoE's config has pad_token_id 1: transformers' embedding leaves that row untrained,
    moezero's does not (the fixture sets no pad token; with one, embed.weight lands 3.4e-2
    relative off DeepSpeed's)."""
    import shutil

    from moezero.cli import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "olmoe_z2_w2" / "ckpt", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "pad_token_id": 1}))
    assert main(["import-deepspeed", str(ckpt), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "not carried over: embedding padding_idx 1: transformers gives row 1 of " \
        "embed_tokens no gradient, moezero trains it" in out, out
    assert main(["import-deepspeed", str(FIXTURES / "olmoe_z2_w2" / "ckpt"), "--out",
                 str(tmp_path / "out2")]) == 0
    assert "padding_idx" not in capsys.readouterr().out


def test_train_with_the_imported_config_resumes_with_deepspeeds_settings(imported, tmp_path):
    from tests.torch_impl.test_cli import moezero

    res = moezero("train", "--nproc", "1", "--config", str(imported / "mixtral_z2_w2" /
                                                          "config.yaml"),
                  "--set", "moe.ep_size=1", "--set", "train.steps=3", "--set", "train.seq_len=12",
                  "--out", str(tmp_path / "run"), timeout=240)
    assert res.returncode == 0, res.stderr
    assert "resumed from" in res.stdout and "step_00000002 at step 2" in res.stdout
    (metrics,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert metrics["step"] == 3 and metrics["lr"] == 1e-2 and metrics["aux_loss"] == 0.0


# ---------------------------------------------------------------------------- settings
def test_trainer_style_groups_and_schedules_map_or_are_refused():
    from moezero.checkpoint.deepspeed import settings
    from moezero.plan.store import CheckpointError

    ds = {"optimizer": {"type": "AdamW"}, "gradient_clipping": 1.0}
    groups = [{"lr": 2e-4, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.01},
              {"lr": 2e-4, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.0}]
    names = [["model.layers.0.self_attn.q_proj.weight"], ["model.norm.weight", "x.bias"]]
    opt, notes = settings.optimizer_section(ds, groups, names, "f")
    assert opt == {"lr": 2e-4, "betas": [0.9, 0.99], "eps": 1e-6, "weight_decay": 0.01,
                   "no_decay_on_norms": True, "gradient_clipping": 1.0, "warmup_steps": 0,
                   "min_lr_ratio": 1.0} and notes == []
    with pytest.raises(CheckpointError, match=r"weight decays \[0.0, 0.01\]"):
        settings.optimizer_section(ds, groups, names[::-1], "f")
    _, notes = settings.optimizer_section({**ds, "scheduler": {"type": "WarmupLR"}}, groups,
                                          names, "f")
    assert notes and "'WarmupLR'" in notes[0]
    with pytest.raises(CheckpointError, match="only Adam/AdamW"):
        settings.optimizer_section({"optimizer": {"type": "Lamb"}}, groups, names, "f")


def test_deepspeeds_warmup_schedules_map_and_others_are_named():
    """WarmupDecayLR and WarmupCosineLR become ``optimizer.scheduler`` with their peak as
    ``optimizer.lr``; moezero's lr follows DeepSpeed's definitions (computed here by hand at
    iterations in the warmup, the decay and past its end); OneCycle is named in one note."""
    from moezero.checkpoint.deepspeed import settings
    from moezero.config import Config
    from moezero.zero.lr_schedule import scheduled_lr

    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}}
    groups, names = [{"lr": 5e-4}], [["x.weight"]]
    decay = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                 "warmup_num_steps": 4, "total_num_steps": 12,
                                                 "warmup_type": "linear"}}
    opt, notes = settings.optimizer_section({**ds, "scheduler": decay}, groups, names, "f")
    assert notes == [] and opt["lr"] == 1e-3
    assert opt["scheduler"] == {"type": "WarmupDecayLR", "warmup_min_lr": 0.0,
                                "warmup_num_steps": 4, "total_num_steps": 12,
                                "warmup_type": "linear"}
    schedule = Config.model_validate({"optimizer": opt}).optimizer.scheduler
    # step s (applied steps so far) runs at DeepSpeed's iteration s - 1
    for step, want in ((0, 0.0), (1, 0.0), (3, 1e-3 * 2 / 4), (5, 1e-3),
                       (9, 1e-3 * (12 - 8) / (12 - 4)), (20, 0.0)):
        assert scheduled_lr(schedule, step, peak=1e-3) == pytest.approx(want, abs=1e-15), step
    cosine = {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 3, "total_num_steps": 9,
                                                   "warmup_min_ratio": 0.1,
                                                   "cos_min_ratio": 0.01}}
    opt, notes = settings.optimizer_section({**ds, "scheduler": cosine}, groups, names, "f")
    assert notes == [] and opt["lr"] == 2e-3
    schedule = Config.model_validate({"optimizer": opt}).optimizer.scheduler
    for step, ratio in ((0, 0.0), (2, 0.1 + 0.9 * math.log(2) / math.log(3)),
                        (5, 0.01 + 0.99 * (1 + math.cos(math.pi * 2 / 6)) / 2), (30, 0.01)):
        assert scheduled_lr(schedule, step, peak=2e-3) == pytest.approx(2e-3 * ratio), step
    _, notes = settings.optimizer_section({**ds, "scheduler": {"type": "OneCycle"}}, groups,
                                          names, "f")
    assert notes == ["lr scheduler 'OneCycle': not carried over (no moezero counterpart); "
                     "optimizer.lr is the lr of its last step, constant (set "
                     "optimizer.scheduler or warmup_steps yourself)"]


def test_deepspeeds_dynamic_loss_scale_becomes_moezeros():
    from moezero.checkpoint.deepspeed.importer import loss_scaler
    from moezero.checkpoint.deepspeed.pickles import LossScaler

    ds = LossScaler()
    ds.__dict__.update(cur_scale=2.0**14, cur_iter=1250, last_overflow_iter=1000,
                       scale_window=100, cur_hysteresis=1, dynamic=True)
    assert loss_scaler(ds) == {"scale": 16384.0, "good_steps": 49, "hysteresis_left": 1}
    static = LossScaler()
    static.__dict__.update(cur_scale=1.0, dynamic=False)
    assert loss_scaler(static) is None and loss_scaler(None) is None


def test_two_params_mapped_to_one_fqn_are_one_line_naming_both(tmp_path, capsys):
    import shutil

    from moezero.cli import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "native_moe_z2_w2_ep2" / "ckpt", ckpt)
    names = tmp_path / "names.yaml"  # sends w1 to w3: w3 then has two sources
    names.write_text("'model.layers.{L}.*deepspeed_experts.{E}.w1.weight': "
                     "'layers.{L}.moe.experts.{E}.w3.weight'\n")
    code = main(["import-deepspeed", str(ckpt), "--out", str(tmp_path / "out"), "--names",
                 str(names)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "deepspeed_experts.0.w1.weight and " in err[0] and "both map to " \
        "layers.0.moe.experts.0.w3.weight" in err[0], err[0]
    assert not (tmp_path / "out").exists()


def test_model_config_given_for_a_run_saved_without_config_json(tmp_path, capsys):
    """Issue 39: a plain training loop saves no config.json beside the checkpoint;
    ``--model-config`` names it (the file or its folder), and the import equals the one with
    the file beside the checkpoint. A path without a config.json is one line, exit 2."""
    import shutil

    from moezero.cli import main

    beside = tmp_path / "beside"
    import_deepspeed(FIXTURES / "mixtral_z2_w2" / "ckpt", beside)
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "model"
    shutil.copytree(FIXTURES / "mixtral_z2_w2" / "ckpt", ckpt)
    elsewhere.mkdir()
    (ckpt / "config.json").rename(elsewhere / "config.json")
    for i, given in enumerate([elsewhere / "config.json", elsewhere]):
        out = tmp_path / f"out{i}"
        assert main(["import-deepspeed", str(ckpt), "--model-config", str(given),
                     "--out", str(out)]) == 0, capsys.readouterr().err
        ours = sorted(p.name for p in (out / "step_00000002").iterdir())
        assert ours == sorted(p.name for p in (beside / "step_00000002").iterdir())
        for f in ours:
            if f.endswith(".safetensors"):
                assert (out / "step_00000002" / f).read_bytes() == \
                    (beside / "step_00000002" / f).read_bytes(), f
    capsys.readouterr()
    assert main(["import-deepspeed", str(ckpt), "--model-config", str(tmp_path / "nope.json"),
                 "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"moezero: error: --model-config {tmp_path / 'nope.json'}: not a config.json "
                   "nor a folder holding one"), err
    assert not (tmp_path / "bad").exists()
