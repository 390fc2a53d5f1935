"""``moezero import-deepspeed`` against checkpoints the real DeepSpeed 0.19.8 wrote
(tests/fixtures/deepspeed/, made by its make_fixtures.py in DeepSpeed's own venv).

The continuation test: DeepSpeed ran K steps, saved, and ran step K+1 (loss L, parameters P,
recorded in the fixture). moezero imports the step-K checkpoint and runs step K+1 on the same
global batch, at another world size / ep / ZeRO stage: loss == L and parameters == P within
fp32 tolerance; the control (Adam moments dropped) lands far outside it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moezero.checkpoint.deepspeed import import_deepspeed
from moezero.config import load_config
from moezero.plan import store
from moezero.train import setup
from tests.support.compare import rel_err
from tests.support.world import run_world

FIXTURES = Path(os.environ.get("MOEZERO_DS_FIXTURES")  # nox -s deepspeed_fixtures: made anew
                or Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed")
CASES = ("mixtral_z1_w1", "mixtral_z2_w2", "mixtral_z3_w2", "mixtral_z3_w3", "mixtral_z2_w2_cpu")
TOL = 1e-6  # the bound: fp32, relative


def expected_params(case: str, ffn: int) -> dict[str, torch.Tensor]:
    """DeepSpeed's parameters after step K+1 under moezero's FQNs, mapped here by hand from
    transformers 5's Mixtral names (fused experts: gate_up_proj [E, 2F, D], down_proj
    [E, D, F])."""
    after = load_file(FIXTURES / case / "after.safetensors")
    out = {"embed.weight": after.pop("model.embed_tokens.weight"),
           "norm.weight": after.pop("model.norm.weight"),
           "lm_head.weight": after.pop("lm_head.weight")}
    block = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate.weight": "moe.router.weight",
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
    loss = engine.train_step([mine])["loss"]
    return {"start": start, "loss": loss,
            "params": {k: p.detach().float().clone()
                       for k, p in engine.full_parameters().items()}}


def check_continuation(case: str, results: list[dict], tol: float = TOL) -> float:
    ref = json.loads((FIXTURES / case / "reference.json").read_text())
    assert results[0]["start"] == ref["k"]
    assert rel_err(results[0]["loss"], ref["loss"]) <= tol, (results[0]["loss"], ref["loss"])
    got = {k: v for r in results for k, v in r["params"].items()}
    want = expected_params(case, ffn=16)
    assert set(got) == set(want)
    worst = max(rel_err(got[k], want[k]) for k in want)
    assert worst <= tol, worst
    return worst


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    for case in CASES:
        import_deepspeed(FIXTURES / case / "ckpt", root / case)
    return root


def batch(case: str) -> torch.Tensor:
    return load_file(FIXTURES / case / "batch.safetensors")["tokens"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_w1_continues_the_deepspeed_run(imported, case, stage):
    result = continue_one_step(str(imported / case), ["moe.ep_size=1",
                               f"zero_optimization.stage={stage}"], batch(case))
    check_continuation(case, [result])


def test_control_without_adam_moments_is_far_off(imported):
    case = "mixtral_z2_w2"
    result = continue_one_step(str(imported / case), ["moe.ep_size=1"], batch(case),
                               drop_moments=True)
    with pytest.raises(AssertionError):
        check_continuation(case, [result])
    want = expected_params(case, ffn=16)
    worst = max(rel_err(result["params"][k], want[k]) for k in want)
    assert worst > 1e3 * TOL, worst


def test_w2_ep2_continues_the_zero3_run(imported, tmp_path):
    case = "mixtral_z3_w2"
    results = run_world(continue_one_step, 2, tmp_path, str(imported / case),
                        ["moe.ep_size=2", "zero_optimization.stage=2"], batch(case),
                        timeout_s=180)
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


FAULTS = {"forbidden_global": _forbidden_global, "truncated": _truncated,
          "missing_rank": _missing_rank, "partition_of_another_world":
          _partition_of_another_world, "extra_rank": _extra_rank}


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
