"""Expert load you can see (issue 39): the warnings of ``moezero.telemetry.LoadWatch`` (an
expert without tokens, or a layer out of balance, for ``telemetry.dead_expert_steps`` steps:
once per layer), a run with a planted dead expert against a healthy one, and
``expert_load.png`` drawn from the numbers metrics.jsonl holds."""

from __future__ import annotations

import json

import pytest
import torch

import moezero.train as train_module
from moezero.config import load_config
from moezero.report import draw_expert_load, expert_load_grid
from moezero.telemetry import LoadWatch, layer_load

TINY = ["model.dim=16", "model.n_layers=2", "model.n_heads=2", "model.ffn_dim=16",
        "moe.num_experts=4", "moe.ep_size=1", "train.seq_len=16", "train.micro_batch_size=4",
        "train.eval_every=0", "train.log_every=1", "checkpoint.every=0",
        "moe.top_k=1", "train.freeze=['*.router.*']", "telemetry.dead_expert_steps=3"]


def loads(*tokens_by_layer):
    return [layer_load(f"layers.{i}.moe", list(t), 0) for i, t in enumerate(tokens_by_layer)]


def test_a_starved_expert_warns_once_per_layer_after_the_given_steps():
    watch = LoadWatch(dead_steps=3, max_imbalance=10.0)
    seen = [watch.update(s, loads([0, 5, 5, 6], [4, 4, 4, 4])) for s in (1, 2)]
    assert seen == [[], []]
    line, = watch.update(3, loads([0, 5, 5, 6], [4, 4, 4, 4]))
    assert line.startswith("moezero: warning: step 3: layers.0.moe: expert 0 received no "
                           "tokens for 3 steps"), line
    assert watch.update(4, loads([0, 5, 5, 6], [4, 4, 4, 4])) == []  # once per layer
    watch.update(5, loads([0, 5, 5, 6], [0, 0, 8, 8]))
    watch.update(6, loads([0, 5, 5, 6], [0, 0, 8, 8]))
    line, = watch.update(7, loads([0, 5, 5, 6], [0, 0, 8, 8]))
    assert "layers.1.moe: experts 0, 1 received no tokens for 3 steps" in line, line


def test_a_run_of_tokens_resets_the_count_and_imbalance_warns_too():
    watch = LoadWatch(dead_steps=2, max_imbalance=2.5)
    assert watch.update(1, loads([0, 4, 4, 4])) == []
    assert watch.update(2, loads([1, 4, 4, 4])) == []  # expert 0 got a token: count restarts
    assert watch.update(3, loads([0, 4, 4, 4])) == []
    assert watch.update(4, loads([30, 1, 1, 1])) == []  # imbalance 3.6: first step above
    line, = watch.update(5, loads([30, 1, 1, 1]))
    assert "layers.0.moe: expert imbalance 3.64 (max / mean tokens) above 2.5 for 2 steps" in line
    assert LoadWatch(0, 2.5).update(1, loads([0, 0, 0, 9])) == []  # 0: never


def plant_dead_expert(model) -> None:
    """Every router's expert 0 never chosen: its weight row 0 (logit 0), and expert 2's row
    minus expert 1's, so one of those two has a logit above 0 for every token (top-1)."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("moe.router"):
                module.weight[0].zero_()
                module.weight[2].copy_(-module.weight[1])


def run(tmp_path, monkeypatch, capsys, plant: bool = False, extra=()):
    """A 6-step run in this process (W = 1, the routers frozen); ``plant``: a dead expert 0 in
    every layer, planted after setup."""
    real_setup = train_module.setup

    def planted(cfg, *args, **kw):
        engine, batches = real_setup(cfg, *args, **kw)
        if plant:
            plant_dead_expert(engine.model)
        return engine, batches

    monkeypatch.setattr(train_module, "setup", planted)
    cfg = load_config(None, [*TINY, "train.steps=6", *extra])
    train_module.train(cfg, tmp_path / "run")
    out = capsys.readouterr().out
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [line for line in out.splitlines() if "warning" in line], rows


def test_a_planted_dead_expert_warns_once_per_layer(tmp_path, monkeypatch, capsys):
    warnings, rows = run(tmp_path, monkeypatch, capsys, plant=True)
    assert all(layer["tokens_per_expert"][0] == 0 for r in rows for layer in r["moe"])
    assert warnings == [f"moezero: warning: step 3: layers.{i}.moe: expert 0 received no "
                        "tokens for 3 steps (router collapse? expert_load.png shows the load; "
                        "docs/finetune.md, 'Expert load')" for i in range(2)], warnings


def test_a_healthy_run_never_warns(tmp_path, monkeypatch, capsys):
    """Even at 3 steps (the default is 50), the healthy tiny run starves no expert."""
    warnings, rows = run(tmp_path, monkeypatch, capsys)
    assert warnings == []
    assert all(min(layer["tokens_per_expert"]) > 0 for r in rows for layer in r["moe"])
    assert load_config(None).telemetry.dead_expert_steps == 50


def test_expert_load_png_is_drawn_from_the_metrics_numbers(tmp_path, monkeypatch, capsys):
    run(tmp_path, monkeypatch, capsys)
    path = tmp_path / "run" / "expert_load.png"
    assert path.stat().st_size > 1000 and (tmp_path / "run" / "loss.png").exists()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps, names, grid = expert_load_grid(rows)  # the numbers as metrics.jsonl holds them
    assert steps == [1, 2, 3, 4, 5, 6] and names == ["layers.0.moe", "layers.1.moe"]
    for i, layer in enumerate(names):
        for s, row in enumerate(rows):
            tokens = row["moe"][i]["tokens_per_expert"]
            assert row["moe"][i]["layer"] == layer
            assert [grid[i][e][s] for e in range(4)] == [n / sum(tokens) for n in tokens]
    assert all(sum(col) == pytest.approx(1.0) for layer in grid for col in zip(*layer, strict=True))


def test_the_tensorboard_image(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moezero.telemetry import TensorBoard

    rows = [{"step": s, "moe": loads([s, 2, 3, 4], [1, 1, 1, 1])} for s in (1, 2, 3)]
    tb = TensorBoard(tmp_path / "tb")
    draw_expert_load(rows, tmp_path / "expert_load.png", tb)
    tb.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert events.Tags()["images"] == ["moe/expert_load"]
    assert (tmp_path / "expert_load.png").stat().st_size > 1000
