"""Tests of moezero.config: defaults, files, --set overrides, round trips, one-line errors."""

from __future__ import annotations

import json
import pickle

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from moezero.config import (
    DEFAULT_RECIPE,
    Config,
    ConfigError,
    MoEConfig,
    dump_config,
    load_config,
    parse_override,
    to_yaml,
)
from moezero.distributed.devices import resolve_backend


def _sections(model: type[BaseModel]):
    yield model
    for field in model.model_fields.values():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _sections(field.annotation)


def test_defaults_are_valid_and_as_documented():
    cfg = load_config()
    assert cfg == Config()
    assert (cfg.train.steps, cfg.train.micro_batch_size, cfg.train.seq_len) == (300, 8, 128)
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.ffn_dim) == (128, 4, 4, 256)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.ep_size) == (8, 2, 2)
    assert cfg.moe.capacity_factor is None and cfg.moe.group_name == "ep_size_2"
    assert cfg.precision.dtype == "auto" and cfg.precision.initial_scale_power == 16
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.optimizer.gradient_clipping == 1.0
    assert cfg.zero_optimization.reduce_bucket_size == 50_000_000
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)
    assert cfg.zero_optimization.offload_optimizer.device == "none"
    assert cfg.checkpoint.keep_last == 2 and cfg.checkpoint.async_save is False
    assert cfg.dist.backend == "auto" and cfg.data.path is None


def test_shipped_recipe_equals_defaults():
    assert load_config(DEFAULT_RECIPE) == Config()


def test_every_field_is_documented():
    for model in _sections(Config):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "moe:\n  num_experts: 4\n  top_k: 1\n  capacity_factor: 1.25\n"
        "optimizer:\n  lr: 1e-3\n"  # YAML 1.1 would read 1e-3 as a string
        "zero_optimization:\n  stage: 3\n  offload_param: {device: cpu}\n"
        "checkpoint:\n  async: true\n  load: latest\n"
    )
    cfg = load_config(path)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.capacity_factor) == (4, 1, 1.25)
    assert cfg.optimizer.lr == pytest.approx(1e-3) and isinstance(cfg.optimizer.lr, float)
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert cfg.checkpoint.async_save is True and cfg.checkpoint.load == "latest"
    assert cfg.train == Config().train  # untouched sections keep their defaults


def test_json_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"train": {"steps": 7}, "precision": {"dtype": "fp16"},
                                "optimizer": {"betas": [0.8, 0.9]}}))
    cfg = load_config(path)
    assert cfg.train.steps == 7 and cfg.precision.dtype == "fp16"
    assert cfg.optimizer.betas == (0.8, 0.9)


def test_empty_file_is_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert load_config(path) == Config()


def test_overrides_coerce_types_and_win_over_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train: {steps: 5}\nmoe: {capacity_factor: 2.0}\n")
    cfg = load_config(path, [
        "train.steps=11",
        "optimizer.lr=1e-3",
        "optimizer.betas=[0.9,0.99]",
        "moe.capacity_factor=null",
        "zero_optimization.reduce_bucket_size=5e7",
        "zero_optimization.stage=2",
        "zero_optimization.offload_optimizer.device=nvme",
        "zero_optimization.offload_optimizer.nvme_path=/tmp/swap",
        "checkpoint.async=true",
        "data.path=corpus.txt",
    ])
    assert cfg.train.steps == 11
    assert cfg.optimizer.lr == pytest.approx(1e-3) and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.betas == (0.9, 0.99)
    assert cfg.moe.capacity_factor is None
    assert cfg.zero_optimization.reduce_bucket_size == 50_000_000
    assert cfg.zero_optimization.offload_optimizer.nvme_path == "/tmp/swap"
    assert cfg.checkpoint.async_save is True
    assert cfg.data.path == "corpus.txt"


def test_async_by_either_name_and_later_wins(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("checkpoint:\n  async: true\n")
    assert load_config(path, ["checkpoint.async_save=false"]).checkpoint.async_save is False
    assert load_config(overrides=["checkpoint.async_save=true"]).checkpoint.async_save is True
    assert load_config(overrides=["checkpoint={async: true}"]).checkpoint.async_save is True


def test_section_override_merges():
    cfg = load_config(overrides=["moe={top_k: 1, num_experts: 4}"])
    assert (cfg.moe.top_k, cfg.moe.num_experts, cfg.moe.ep_size) == (1, 4, 2)


@pytest.mark.parametrize("text, keys, value", [
    ("a.b.c=1", ["a", "b", "c"], 1),
    ("optimizer.lr=1e-3", ["optimizer", "lr"], 1e-3),
    ("x=5e7", ["x"], 5e7),
    ("x=null", ["x"], None),
    ("x=", ["x"], None),
    ("x=[0.9,0.95]", ["x"], [0.9, 0.95]),
    ("x=true", ["x"], True),
    ("x=latest", ["x"], "latest"),
    ("x=a=b", ["x"], "a=b"),
])
def test_parse_override(text, keys, value):
    assert parse_override(text) == (keys, value)
    assert type(parse_override(text)[1]) is type(value)


def test_dump_load_round_trip(tmp_path):
    cfg = load_config(overrides=["moe.expert_group_name=experts", "moe.max_group_size=4096",
                                 "checkpoint.async=true", "optimizer.expert_lr=1e-4",
                                 "precision.dtype=bf16", "train.out_dir=runs/x"])
    path = tmp_path / "config.yaml"
    dump_config(cfg, path)
    assert load_config(path) == cfg
    assert "async: true" in path.read_text()  # the key users write, not the field name
    assert Config.model_validate(cfg.model_dump()) == cfg
    assert Config.model_validate(cfg.model_dump(by_alias=True)) == cfg
    assert Config.model_validate(yaml.safe_load(to_yaml(cfg))) == cfg
    json_path = tmp_path / "config.json"
    json_path.write_text(cfg.model_dump_json(by_alias=True))
    assert load_config(json_path) == cfg


def test_group_name_resolution():
    assert MoEConfig(ep_size=4).group_name == "ep_size_4"
    assert MoEConfig(expert_group_name="my_experts").group_name == "my_experts"


def test_helpers_resolve_auto():
    cfg = Config()
    assert cfg.precision.resolve(cuda=False, bf16_supported=False) == "fp32"
    assert cfg.precision.resolve(cuda=True, bf16_supported=True) == "bf16"
    assert resolve_backend(cfg.dist.backend, 0) == "gloo"
    assert resolve_backend(cfg.dist.backend, 1) == "nccl"
    assert cfg.optimizer.model_copy(update={"gradient_clipping": 0.0}).max_grad_norm is None
    assert str(cfg.checkpoint.resolve_dir("runs/a")) == "runs/a/checkpoints"


def test_invalid_assignment_is_rejected_and_undone():
    cfg = Config()
    with pytest.raises(ValidationError):
        cfg.moe.top_k = 99  # > num_experts: a model validator, after the field check
    assert cfg.moe.top_k == 2
    with pytest.raises(ValidationError):
        cfg.zero_optimization.stage = 5
    assert cfg.zero_optimization.stage == 2


# (file contents or None, --set overrides, dotted key the one-line error must name)
BAD = [
    ("unknown top-level", {"trian": {"steps": 1}}, [], "trian: unknown key"),
    ("unknown nested", {"zero_optimization": {"stagee": 2}}, [], "zero_optimization.stagee: unknown key"),
    ("unknown --set", None, ["moe.topk=1"], "moe.topk: unknown key"),
    ("unknown deep --set", None, ["zero_optimization.offload_param.devic=cpu"],
     "zero_optimization.offload_param.devic: unknown key"),
    ("stage 5", {"zero_optimization": {"stage": 5}}, [], "zero_optimization.stage:"),
    ("dtype fp8", None, ["precision.dtype=fp8"], "precision.dtype:"),
    ("negative lr", {"optimizer": {"lr": -0.1}}, [], "optimizer.lr:"),
    ("lr not a number", None, ["optimizer.lr=fast"], "optimizer.lr:"),
    ("beta >= 1", None, ["optimizer.betas=[0.9,1.0]"], "optimizer.betas.1:"),
    ("top_k > num_experts", {"moe": {"num_experts": 4, "top_k": 5}}, [], "moe.top_k:"),
    ("ep_size not dividing", None, ["moe.num_experts=6", "moe.ep_size=4"], "moe.ep_size:"),
    ("capacity_factor 0", None, ["moe.capacity_factor=0"], "moe.capacity_factor:"),
    ("max_group_size 0", None, ["moe.max_group_size=0"], "moe.max_group_size:"),
    ("group name with slash", None, ["moe.expert_group_name=a/b"], "moe.expert_group_name:"),
    ("nvme without path", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     [], "zero_optimization.offload_optimizer.nvme_path:"),
    ("offload_param at stage 2", None,
     ["zero_optimization.stage=2", "zero_optimization.offload_param.device=cpu"],
     "zero_optimization.offload_param.device:"),
    ("offload_optimizer at stage 0", None, ["zero_optimization.stage=0",
                                            "zero_optimization.offload_optimizer.device=cpu"],
     "zero_optimization.offload_optimizer.device:"),
    ("read_ahead negative", None, ["zero_optimization.offload_param.read_ahead=-1"],
     "zero_optimization.offload_param.read_ahead:"),
    ("read_ahead not a number", {"zero_optimization": {"offload_param": {"read_ahead": "two"}}},
     [], "zero_optimization.offload_param.read_ahead:"),
    ("read_ahead of the optimizer", None, ["zero_optimization.offload_optimizer.read_ahead=2"],
     "zero_optimization.offload_optimizer.read_ahead: unknown key"),
    ("keep_for_backward below stage 3", None,
     ["zero_optimization.stage=2", "zero_optimization.offload_param.keep_for_backward=1000"],
     "zero_optimization.offload_param.keep_for_backward:"),
    ("keep_grads without the nvme gradient tier", None,
     ["zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu",
      "zero_optimization.offload_optimizer.keep_grads=1000"],
     "zero_optimization.offload_optimizer.keep_grads:"),
    ("read_in_backward without nvme state", None,
     ["zero_optimization.stage=2", "zero_optimization.offload_optimizer.read_in_backward=1000"],
     "zero_optimization.offload_optimizer.read_in_backward:"),
    ("step_in_forward without nvme params", None,
     ["zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=nvme",
      "zero_optimization.offload_optimizer.nvme_path=/tmp",
      "zero_optimization.offload_optimizer.step_in_forward=true"],
     "zero_optimization.offload_optimizer.step_in_forward:"),
    ("keep_last 0", {"checkpoint": {"keep_last": 0}}, [], "checkpoint.keep_last:"),
    ("async not a bool", None, ["checkpoint.async=maybe"], "checkpoint.async:"),
    ("malformed --set", None, ["train.steps"], "train.steps:"),
    ("--set under a value", None, ["moe.top_k.x=1"], "moe.top_k:"),
    ("heads not dividing dim", {"model": {"dim": 130}}, [], "model.dim:"),
    ("odd head dim", None, ["model.dim=12", "model.n_heads=4"], "model.dim:"),
    ("synthetic vocab > vocab", None, ["model.vocab_size=16"], "data.synthetic_vocab:"),
    ("section not a mapping", {"moe": 3}, [], "moe:"),
    ("infinite timeout", None, ["dist.timeout_s=.inf"], "dist.timeout_s:"),
    ("several errors", {"train": {"steps": 0}, "model": {"dim": -1}}, [], "train.steps:"),
]


@pytest.mark.parametrize("name, content, sets, expected", BAD, ids=[row[0] for row in BAD])
def test_bad_config_is_one_line_naming_the_key(tmp_path, name, content, sets, expected):
    path = None
    if content is not None:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(content))
    with pytest.raises(ConfigError) as info:
        load_config(path, sets)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(expected), message
    assert message.endswith(")"), message  # ends with where it came from
    where = str(path) if content is not None and not sets else "--set "
    assert where in message, message


@pytest.mark.parametrize("text, expected", [
    ("[1, 2]\n", "config: top level must be a mapping"),
    ("just a string\n", "config: top level must be a mapping"),
    ("train: {steps: [\n", "config: not valid YAML"),
])
def test_bad_file_is_one_line(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(expected) and str(path) in str(info.value)


def test_bad_json_is_one_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train": {"steps": 3,}}')
    with pytest.raises(ConfigError, match=r"^config: not valid JSON") as info:
        load_config(path)
    assert "\n" not in str(info.value)


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config: file not found ({path})"


def test_error_points_at_the_input_that_set_the_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("moe: {top_k: 3}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["moe.num_experts=2"])
    # top_k came from the file, but the error is the same either way: it names moe.top_k
    assert str(info.value).startswith("moe.top_k: must be <= moe.num_experts (2), got 3 (")
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["zero_optimization.stagee=2"])
    assert str(info.value) == ("zero_optimization.stagee: unknown key; did you mean "
                               "'zero_optimization.stage'? "
                               "(--set zero_optimization.stagee=2)")


def test_config_error_pickles():
    err = ConfigError("moe.top_k", "too big", "--set moe.top_k=9", ["x: y (z)"])
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) == "moe.top_k: too big (--set moe.top_k=9); x: y (z)"
    assert (back.key, back.where) == ("moe.top_k", "--set moe.top_k=9")


def test_a_heartbeat_below_a_second_is_refused():
    """issue 38 #12: ``dist.heartbeat_s=1e-4`` was accepted, then every run was stopped as
    hung; the schema refuses a heartbeat under 1 s in one line."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["dist.heartbeat_s=1e-4"])
    line = str(err.value)
    assert "\n" not in line and line.startswith("dist.heartbeat_s: "), line
    assert "greater than or equal to 1" in line, line
    assert load_config(None, ["dist.heartbeat_s=1"]).dist.heartbeat_s == 1.0
