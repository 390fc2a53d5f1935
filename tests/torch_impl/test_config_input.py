"""Config input taken as written (docs: README "Configuration"): ``--set`` values with '#'
kept literally, duplicate keys in a recipe refused, near-miss keys answered with the full key."""

from __future__ import annotations

import pytest

from moezero.config import ConfigError, load_config


@pytest.mark.parametrize("value", ["/data/ck #2", "/data/ck#2", "#ck", "/data/ck  # two"])
def test_a_hash_in_a_set_value_is_kept(value):
    cfg = load_config(None, [f"checkpoint.dir={value}"])
    assert cfg.checkpoint.dir == value


@pytest.mark.parametrize("text,want", [("train.steps=7", 7), ("optimizer.lr=1e-3", 1e-3),
                                       ("train.preempt_signals=[SIGTERM]", ["SIGTERM"]),
                                       ("checkpoint.dir='a #b'", "a #b")])
def test_values_without_a_comment_are_still_yaml(text, want):
    cfg = load_config(None, [text])
    section, key = text.split("=")[0].split(".")
    assert getattr(getattr(cfg, section), key) == want


@pytest.mark.parametrize("suffix,text,line", [
    (".yaml", "train:\n  steps: 3\n  seed: 1\n  steps: 5\n", "train.steps"),
    (".yaml", "moe: {top_k: 1}\ntrain: {steps: 2}\nmoe: {top_k: 2}\n", "moe"),
    (".json", '{"train": {"steps": 3, "steps": 5}}', "train.steps"),
])
def test_a_key_given_twice_in_a_file_is_refused_naming_it(tmp_path, suffix, text, line):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert msg.startswith(f"{line}: given twice") and str(path) in msg and "\n" not in msg, msg


@pytest.mark.parametrize("override,want", [
    ("zero.stage=3", "zero: unknown key; did you mean 'zero_optimization.stage'?"),
    ("zero_optimization.stag=3", "did you mean 'zero_optimization.stage'?"),
    ("zero_optim.stage=3", "did you mean 'zero_optimization.stage'?"),
    ("optim.lr=0.1", "did you mean 'optimizer.lr'?"),
    ("ckpt.every=3", "unknown key ("),  # nothing close: no guess
])
def test_near_miss_keys_suggest_the_full_key(override, want):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert want in str(info.value), str(info.value)
