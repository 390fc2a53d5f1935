"""benchmarks/deepspeed_scale.py without DeepSpeed: its command line, the DeepSpeed config it
builds, the JSON it writes, and its watchdog turning a memory overrun into a result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import deepspeed_scale as ds

REPO = Path(__file__).resolve().parent.parent
COMMAND = ["--params-b", "2.0", "--nvme", "swap", "--steps", "3", "--seq", "128", "--batch", "1",
           "--out", "r.json"]
KEYS = {"ok", "error", "kind", "params", "peak_rss_bytes", "peak_anon_bytes", "init_s", "step_s",
        "swap_bytes", "config"}


def test_the_issue_command_line_parses_with_autoep_by_default():
    args = ds.parser().parse_args(COMMAND)
    assert (args.params_b, args.nvme, args.steps, args.seq, args.batch, args.out) == \
        (2.0, "swap", 3, 128, 1, "r.json")
    assert args.kind == "autoep" and args.max_rss_gib == 16.0 and args.timeout_min == 40.0


def test_config_is_zero3_with_params_and_optimizer_on_nvme():
    args = ds.parser().parse_args([*COMMAND, "--nvme", "/tmp/swap"])
    largest = 134_217_728 + 5  # a partition of it must fit one param swap buffer
    cfg = ds.ds_config(args, largest, world=2)
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_prefetch_bucket_size"] == 0
    # with the default reuse distance gathered params kept their swap buffers: step 2 failed
    assert zero["stage3_max_reuse_distance"] == zero["stage3_max_live_parameters"] == 0
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    assert zero["offload_param"]["nvme_path"] == "/tmp/swap"
    assert zero["offload_param"]["buffer_size"] * 2 >= largest
    assert zero["offload_param"]["buffer_size"] % 2**20 == 0
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    assert "fp16" not in cfg and "bf16" not in cfg  # fp32
    assert cfg["expert_parallel"] == {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}
    dense = ds.ds_config(ds.parser().parse_args([*COMMAND, "--kind", "dense"]), largest, world=2)
    assert "expert_parallel" not in dense


def test_the_first_result_written_wins(tmp_path):
    out = str(tmp_path / "r.json")
    assert ds.write_once(out, {"who": 1})
    assert not ds.write_once(out, {"who": 2})
    assert json.loads(Path(out).read_text()) == {"who": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary left


def test_a_memory_overrun_is_written_as_the_result_and_ends_the_rank(tmp_path):
    out = tmp_path / "r.json"
    script = ("import sys, time; sys.path.insert(0, sys.argv[1])\n"
              "from benchmarks import deepspeed_scale as ds\n"
              "args = ds.parser().parse_args(sys.argv[2:])\n"
              "ds.Run(args, rank=1, world=2); time.sleep(30)\n")
    argv = [*COMMAND, "--nvme", str(tmp_path), "--out", str(out), "--max-rss-gib", "0.01"]
    proc = subprocess.run([sys.executable, "-c", script, str(REPO), *argv], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 1
    got = json.loads(out.read_text())
    assert KEYS <= set(got) and got["ok"] is False
    assert got["error"].startswith("rank 1: exceeded 0.0 GiB RSS")
    assert got["peak_rss_bytes"][0] is None and got["peak_rss_bytes"][1] > 0
    assert got["peak_anon_bytes"][1] > 0
    assert proc.stderr.strip().splitlines()[-1].startswith("deepspeed_scale: rank 1: exceeded")
