"""benchmarks/finetune_report.py: the adapter count the checkpoint target divides by equals the
LoRA parameters moezero really builds; the section's targets say met or missed from the
measured figures; a failed row and a token-count disagreement are reported. No model runs
(the decoder is built on the meta device); well under a second."""

from __future__ import annotations

import json

import pytest

from benchmarks import finetune_report as fr

MODEL = {"dim": 64, "ffn_dim": 48, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "num_experts": 4, "top_k": 2, "aux_loss_coef": 0.001}
TRAIN = {"seq_len": 32, "micro_batch_size": 2, "lr": 1e-3, "seed": 0, "r": 4, "alpha": 8,
         "warmup": 1, "timed": 2}


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_adapter_params_are_the_lora_params_moezero_builds(kv_heads):
    from moezero.config import load_config
    from moezero.model.build import config_decoder

    model = {**MODEL, "n_kv_heads": kv_heads}
    cfg = load_config(None, [f"model.dim={model['dim']}", f"model.ffn_dim={model['ffn_dim']}",
                             f"model.n_layers={model['n_layers']}",
                             f"model.n_heads={model['n_heads']}", f"model.n_kv_heads={kv_heads}",
                             f"moe.num_experts={model['num_experts']}", "moe.ep_size=1",
                             "peft.method=lora", "peft.r=4", "peft.targets=[attn, experts]"])
    decoder = config_decoder(cfg, where="meta")
    built = sum(p.numel() for name, p in decoder.named_parameters()
                if name.endswith(("lora_A", "lora_B")))
    assert built > 0
    assert fr.adapter_params(model, 4) == built


def _rank(tokens_s: float, anon: int, ckpt: int) -> dict:
    return {"step_s": [1.0, 1.0], "trained": [tokens_s, tokens_s], "seen": [2 * tokens_s] * 2,
            "losses": [6.0, 5.5], "anon_peak": anon, "peak_rss": anon + 100,
            "checkpoint": {"bytes": ckpt, "files": 3, "save_s": 0.1},
            "dataset": {"tokens": 1000, "trained": 400, "rows": 9}, "trainable_numel": 7}


def _results(peer: dict, lora_ckpt: int, dataset_trained: int = 400) -> dict:
    params = fr.adapter_params(MODEL, TRAIN["r"])
    lora = {"status": "ok", "ranks": [_rank(300.0, 60, lora_ckpt)] * 2, "wall_s": 1.0}
    if peer["status"] == "ok":
        peer["ranks"][0]["dataset"] = {**peer["ranks"][0]["dataset"], "trained": dataset_trained}
    return {"machine": {"date": "d"}, "command": "c", "load_before": (1.0, 1.0, 1.0),
            "load_after": (1.5, 1.0, 1.0),
            "finetune": {"size": {"model": MODEL, "train": TRAIN},
                         "inputs": {"params": 10, "vocab": 50, "documents": 9, "longest": 30,
                                    "tokens": 1000, "trained": 400},
                         "runs": {"moezero LoRA, stage 2": lora,
                                  "moezero full SFT, stage 2": {"status": "ok", "wall_s": 1.0,
                                                                "ranks": [_rank(100.0, 90,
                                                                                12 * params)] * 2},
                                  fr.PEER_KEY + " peer": peer}},
            "_params": params}


def _peer(tokens_s: float, anon: int) -> dict:
    return {"status": "ok", "ranks": [_rank(tokens_s, anon, 5), _rank(tokens_s, anon, 5)],
            "wall_s": 1.0}


def test_the_targets_say_met_or_missed():
    res = _results(_peer(150.0, 100), lora_ckpt=0)
    res["finetune"]["runs"]["moezero LoRA, stage 2"]["ranks"][0]["checkpoint"]["bytes"] = \
        int(1.05 * 12 * res["_params"])
    text = "\n".join(fr.section(res))
    assert "| 2.00× (moezero LoRA, stage 2) | met |" in text
    assert "| 0.60× (moezero LoRA, stage 2) | met |" in text
    assert "| 1.050× (" in text and "the same counts" in text
    slow = "\n".join(fr.section(_results(_peer(250.0, 80), lora_ckpt=12 * 2 * res["_params"])))
    assert "| 1.20× (moezero LoRA, stage 2) | missed by 20% |" in slow
    assert "| 0.75× (moezero LoRA, stage 2) | missed by 7% |" in slow
    assert "| 2.000× (" in slow and "missed by 82%" in slow


def test_a_failed_peer_and_a_count_mismatch_are_reported():
    failed = _results({"status": "failed", "error": "ValueError: no deepspeed"}, lora_ckpt=1)
    text = "\n".join(fr.section(failed))
    assert "| failed: ValueError: no deepspeed |" in text
    assert "not measured: TRL peer failed" in text
    mismatch = "\n".join(fr.section(_results(_peer(150.0, 100), 1, dataset_trained=399)))
    assert "399 trained" in mismatch and "**different** counts" in mismatch


def test_a_series_that_runs_alone_is_refused_beside_others(capsys):
    """scale, hoststep and finetune run alone; beside another series they were skipped
    without a word (only `--series X` alone reached them)."""
    from benchmarks.run import main
    with pytest.raises(SystemExit) as exc:
        main(["--series", "main", "--series", "finetune", "--work-dir", "/nonexistent/x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "finetune" in err and "alone" in err, err


TINY = {"dim": 32, "ffn_dim": 16, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
        "num_experts": 8, "top_k": 2, "aux_loss_coef": 0.001}


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "qwen3_next"])
def test_each_family_imports_and_both_sides_adapt_what_it_has(family):
    """Each row's HF config is one moezero imports (its family's checks, the LoRA targets
    validated against the adopted architecture), and every PEFT target the peer names is a
    module or parameter of the transformers model (built on the meta device)."""
    import torch
    import transformers

    from benchmarks import finetune_models as fm
    from moezero.checkpoint.hf.families import family_of_config
    from moezero.config import Config

    cfg = fm.hf_config(family, TINY, 64)
    raw = cfg.to_dict()
    arch = family_of_config(raw, "config.json").read(raw, "config.json")
    spec = fm.FAMILIES[family]
    sections = arch.sections()
    Config.model_validate({**sections, "moe": {**sections["moe"], "ep_size": 2},
                           "peft": {"method": "lora", "targets": list(spec.targets)}})
    with torch.device("meta"):
        model = getattr(transformers, spec.hf_class)(cfg)
    modules = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    params = {name.split(".", 3)[-1] for name, _ in model.named_parameters()}
    assert set(spec.peer_modules) <= modules
    assert all(any(p.endswith(t) for p in params) for t in spec.peer_parameters)


def _family(mine: tuple[float, float], peer: dict, anon: int = 60) -> dict:
    """A family's runs: one moezero row run twice (trained tokens/s ``mine``), the peer."""
    runs = [{"status": "ok", "ranks": [_rank(t, anon, 9)] * 2, "wall_s": 1.0} for t in mine]
    return {"params": 1234, "hf": "h", "base": "b",
            "runs": {"moezero LoRA, stage 0": {"repeats": runs}, fr.PEER_KEY + " peer": peer}}


def test_the_family_section_reports_repeats_targets_and_failures():
    """Repeats: the median tokens/s with each repeat's, the largest peak; each family's two
    targets met or missed; a row whose runs all failed is failed, one with some failed says
    so beside the figures of the others; only the families that ran."""
    from benchmarks import finetune, finetune_families

    base = _results(_peer(150.0, 100), lora_ckpt=1)
    gone = {"status": "failed", "error": "OSError: gone"}
    base["finetune"]["runs"]["moezero LoRA, stage 2"] = {
        "repeats": [base["finetune"]["runs"]["moezero LoRA, stage 2"], gone]}
    failed = {"repeats": [gone, {"status": "failed", "error": "OSError: again"}]}
    base["finetune"]["runs"]["TRL peer"] = {"repeats": [gone, base["finetune"]["runs"]["TRL peer"]]}
    unpacked = _peer(100.0, 80)
    unpacked["spec"] = {"packing": False, "micro_batch_size": 8}
    base["finetune"]["families"] = {
        "qwen3_moe": {"params": 10, "runs": base["finetune"].pop("runs")},
        "gpt_oss": _family((300.0, 340.0), {"repeats": [_peer(100.0, 100)] * 2}),
        "deepseek_v3": _family((120.0, 140.0), {"repeats": [unpacked] * 2}),
        "qwen3_next": _family((300.0, 300.0), failed)}
    qwen, families = finetune.sections(base)
    assert qwen[0] == fr.SECTION and families[0] == finetune_families.SECTION
    text = "\n".join(families)
    assert "| gpt-oss | moezero LoRA, stage 0 | 320 (300 / 340) |" in text
    assert "| gpt-oss | ≥ 1.5× the peer's trained tokens/s per rank | 3.20× (" in text
    assert "| DeepSeek-V3 | ≥ 1.5× the peer's trained tokens/s per rank | 1.30× " \
           "(moezero LoRA, stage 0) | missed by 13% |" in text
    assert "| DeepSeek-V3 | ≤ 0.7× the peer's peak anon per rank | 0.75× " \
           "(moezero LoRA, stage 0) | missed by 7% |" in text
    assert "failed: OSError: gone" in text and "not measured: TRL peer failed" in text
    assert "| moezero LoRA, stage 2 | 300; 1 more run(s) failed: OSError: gone |" in \
        "\n".join(qwen)
    assert "one conversation per row, right-padded, 8 per micro-batch" in text
    del base["finetune"]["families"]["qwen3_moe"], base["finetune"]["families"]["gpt_oss"]
    (only,) = finetune.sections(base)
    assert "| gpt-oss |" not in "\n".join(only) and "DeepSeek-V3 (1,234 params" in "\n".join(only)


def test_families_measured_one_at_a_time_make_one_section(tmp_path):
    """``--only`` runs of one family each: the results keep the earlier families (same
    sizes), in the series' order, each with its own command and load line."""
    from benchmarks import finetune, finetune_families

    def one(family: str, when: str) -> dict:
        fam = _family((300.0, 300.0), {"repeats": [_peer(100.0, 100)]})
        fam["run"] = {"command": f"run {family}", "date": when, "uptime_before": "u1",
                      "uptime_after": "u2"}
        res = _results(_peer(150.0, 100), lora_ckpt=1)
        res["finetune"].pop("runs")
        res["finetune"]["families"] = {family: fam}
        return res

    path = tmp_path / "results-finetune.json"
    path.write_text(json.dumps(finetune.merged(path, one("qwen3_next", "t1"))))
    both = finetune.merged(path, one("gpt_oss", "t2"))
    assert list(both["finetune"]["families"]) == ["gpt_oss", "qwen3_next"]
    text = "\n".join(finetune_families.section(both))
    assert "- gpt-oss: `run gpt_oss` (t2; `uptime` before: u1; after: u2)." in text
    assert "- Qwen3-Next: `run qwen3_next` (t1;" in text
    other = one("gpt_oss", "t3")
    other["finetune"]["size"] = {**other["finetune"]["size"], "train": {**TRAIN, "timed": 9}}
    assert list(finetune.merged(path, other)["finetune"]["families"]) == ["gpt_oss"]


def test_only_picks_families_and_rows():
    from benchmarks.finetune import FAMILY_ROWS, keep_row, selected

    assert selected([]) == ["qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_next"]
    assert selected(["gpt-oss", "deepseek", "stage 0"]) == ["gpt_oss", "deepseek_v3"]
    assert selected(["stage 0"]) == selected([])
    names = [n for n, _ in FAMILY_ROWS]
    assert [n for n in names if keep_row(n, names, ["gpt-oss"])] == names
    assert [n for n in names if keep_row(n, names, ["gpt-oss", "stage 0"])] == \
        ["moezero LoRA, stage 0"]
