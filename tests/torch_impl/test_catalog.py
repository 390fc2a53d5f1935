"""Packaged recipes by name (``moezero.catalog``): ``--config NAME``, ``moezero recipes``, and
the one-line error of an unknown name."""

from __future__ import annotations

import pytest

from moezero import cli
from moezero.catalog import RECIPES, read_recipe, recipes, resolve
from moezero.config import ConfigError, load_config


def test_a_name_finds_the_packaged_recipe():
    for name in ("qwen3-moe-30b-a3b-lora", "qwen3-moe-30b-a3b-lora.yaml"):
        assert resolve(name) == str(RECIPES / "qwen3-moe-30b-a3b-lora.yaml")
    cfg = load_config(resolve("qwen3-moe-30b-a3b-lora"), ["checkpoint.load=null"])
    assert cfg.moe.num_experts == 128 and cfg.peft.r == 16


def test_a_path_still_works(tmp_path, monkeypatch):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("train:\n  steps: 7\n")
    assert resolve(str(recipe)) == str(recipe)
    monkeypatch.chdir(tmp_path)  # a file of that name here wins over the packaged ones
    (tmp_path / "default").write_text("train:\n  steps: 9\n")
    assert resolve("default") == "default"
    assert resolve(None) is None
    assert resolve("/no/such/recipe.yaml") == "/no/such/recipe.yaml"  # load_config says so


def test_an_unknown_name_lists_the_close_ones_in_one_line():
    with pytest.raises(ConfigError) as err:
        resolve("qwen3-30b-lora")
    text = str(err.value)
    assert "\n" not in text and "close: qwen3-moe-30b-a3b-lora" in text, text
    with pytest.raises(ConfigError) as err:
        resolve("zzzz")
    assert "known: " + ", ".join(r.name for r in recipes()) in str(err.value)


def test_an_unknown_name_at_the_cli_is_one_line_exit_2(capsys):
    assert cli.main(["estimate", "--config", "mixtral-8x8b", "--nproc", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "close: mixtral-8x7b" in err, err


def test_every_recipe_has_a_header():
    for recipe in recipes():
        assert recipe.model and recipe.hardware and recipe.nproc >= 1, recipe
        assert recipe.device in ("cpu", "cuda"), recipe


def test_a_recipe_without_a_header_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: 1\n")
    with pytest.raises(ConfigError, match="first line must be"):
        read_recipe(bad)


def test_moezero_recipes_lists_one_line_each(capsys):
    assert cli.main(["recipes"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == [r.name for r in recipes()]
    lora = next(line for line in lines if line.startswith("qwen3-moe-30b-a3b-lora "))
    assert "Qwen3-30B-A3B" in lora and "8 GPUs" in lora and " GiB GPU" in lora, lora
    assert "--nproc 8" in lora
