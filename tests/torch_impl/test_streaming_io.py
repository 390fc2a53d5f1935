"""Streaming checkpoint I/O (issue 16, item 2): loading a checkpoint into an engine,
``import-hf`` of a sharded Hugging Face checkpoint and ``checkpoint export`` hold bounded
chunks, never a whole model nor a whole large tensor or group, in host memory.

Each test measures the peak RSS growth of the action alone in a fresh child process
(``tests/support/peak.py``: VmHWM reset by clear_refs, fixed mmap threshold), the modules it
needs imported before the measurement starts, and bounds it by ``STREAMING_BUDGET`` of the
model's fp32 bytes. The models are lopsided on purpose: one tensor (the embedding and head of
the HF model) or one optimizer group (all experts of the native model's layer) is about half
the model, so a path that reads a whole tensor or group through a host buffer is over budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moezero.checkpoint.hf.arch import arch_of
from moezero.checkpoint.hf.families import family_for
from moezero.checkpoint.hf.names import hf_name
from moezero.plan import store
from tests.support.peak import peak_growth
from tests.torch_impl.tolerances import STREAMING_BUDGET

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

# One MoE layer whose 8 experts (ffn 2048) are ~100 MB of the model's ~105 MB fp32. Saved with
# small groups; loaded with one group per layer (no cap, not split by expert), so the plan
# changed and each target is read as per-tensor slices.
_NATIVE = r"""
from moezero.config import Config
def native(split, cap, stage=2, nvme=None):
    off = {"device": "nvme", "nvme_path": nvme} if nvme else {"device": "none"}
    return Config.model_validate({
        "model": {"vocab_size": 256, "dim": 512, "n_layers": 1, "n_heads": 4, "ffn_dim": 2048},
        "moe": {"num_experts": 8, "ep_size": 1, "max_group_size": cap,
                "split_groups_by_expert": split},
        "precision": {"dtype": "fp32"},
        "zero_optimization": {"stage": stage, "offload_param": off, "offload_optimizer": off}})
"""

_SAVE = _NATIVE + r"""
from moezero.train import setup
engine = setup(native(True, 1 << 18), torch.device("cpu"))[0]
engine.save_checkpoint(sys.argv[1], step=1)
engine.close()
print(0)
"""

_LOAD = _NATIVE + r"""
from moezero.checkpoint.model_buffers import buffer_targets
from moezero.train import setup
root, nvme = sys.argv[1], (sys.argv[2] if sys.argv[2] != "-" else None)
engine = setup(native(False, None, 3 if nvme else 2, nvme), torch.device("cpu"))[0]
targets = list(engine.optimizer.load_targets())
growth = measure(lambda: engine.checkpointer.load(root, targets, engine.shapes,
                                                  buffers=buffer_targets(engine.model)))
engine.optimizer.after_load()
model_bytes = sum(4 * s.numel for s in engine.optimizer.slots)
masters = {k: v.clone() for k, v in engine.full_parameters().items()}
from moezero.plan import store
from moezero.plan.store import find_checkpoint
ckpt = find_checkpoint(root)
m = store.read_manifest(ckpt)
same = all(torch.equal(torch.from_numpy(store.read_param(ckpt, m, fqn)).reshape(v.shape),
                       v.float()) for fqn, v in masters.items())
engine.close()
print(growth, model_bytes, int(same))
"""

_IMPORT = r"""
import math
import moezero.checkpoint.hf.importer as importer
from moezero.model.build import build_decoder
from moezero.model.decoder import ModelArgs
from moezero.plan import store
src, out = sys.argv[1], sys.argv[2]
args = ModelArgs(vocab_size=8, dim=8, n_layers=1, n_heads=2, ffn_dim=8, num_experts=2)
build_decoder(args, where="meta")  # a meta build's one-time costs, before measuring
growth = measure(lambda: importer.import_hf(src, out))
m = store.read_manifest(out + "/step_00000000")
print(growth, sum(4 * math.prod(s) for _, s in m.layout.shapes))
"""

_EXPORT = r"""
from pathlib import Path
import moezero.checkpoint.hf.exporter as exporter
from moezero.checkpoint import tools
ckpt, out, dtype, form = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
export = exporter.export_hf if form == "hf" else tools.export
growth = measure(lambda: export(ckpt, out, dtype))
print(growth)
"""


@pytest.fixture(scope="module")
def native_ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("native")
    peak_growth(_SAVE, root / "ckpt")
    return root / "ckpt"


def _budget_check(growth: int, model_bytes: int, what: str) -> None:
    budget = STREAMING_BUDGET * model_bytes
    print(f"{what}: peak RSS growth {growth / 2**20:.1f} MiB, model {model_bytes / 2**20:.1f} "
          f"MiB fp32, budget {budget / 2**20:.1f} MiB")
    assert growth < budget, (what, growth, model_bytes)


@pytest.mark.parametrize("offload", ["nvme-stage3", "none-stage2"])
def test_load_with_a_changed_plan_streams(native_ckpt, tmp_path, offload):
    nvme = "-"
    if offload.startswith("nvme"):
        nvme = tmp_path / "swap"
        nvme.mkdir()
    growth, model_bytes, same = peak_growth(_LOAD, native_ckpt, nvme)
    assert model_bytes > 100e6 and same == 1
    _budget_check(growth, model_bytes, f"load into {offload}")


# A Mixtral of ~300 MB fp32 (150 MB bf16 on disk, in several files with an index) whose
# embedding and head are 134 MB fp32 each.
HF_SIZES = dict(vocab_size=32768, hidden_size=1024, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=8, num_key_value_heads=8, num_local_experts=4,
                num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hf_sharded(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "mixtral"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**HF_SIZES))
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="60MB")
    del model
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    return path


@pytest.fixture(scope="module")
def imported(hf_sharded, tmp_path_factory) -> tuple[Path, list[int]]:
    out = tmp_path_factory.mktemp("imported") / "ckpt"
    return out, peak_growth(_IMPORT, hf_sharded, out)


def test_import_hf_of_a_sharded_checkpoint_streams(imported):
    _, (growth, model_bytes) = imported
    assert model_bytes > 250e6
    _budget_check(growth, model_bytes, "import-hf")


def test_imported_weights_equal_the_hf_tensors(hf_sharded, imported):
    """The streamed import wrote each tensor whole and in place (checked by FQN)."""
    ckpt = imported[0] / "step_00000000"
    m = store.read_manifest(ckpt)
    index = json.loads((hf_sharded / "model.safetensors.index.json").read_text())["weight_map"]
    pairs = {"embed.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
             "layers.0.moe.experts.3.w2.weight": "model.layers.0.block_sparse_moe.experts.3.w2.weight"}
    for fqn, key in pairs.items():
        with safe_open(hf_sharded / index[key], "pt") as f:
            want = f.get_tensor(key).float()
        got = torch.from_numpy(store.read_param(ckpt, m, fqn)).reshape(want.shape)
        assert torch.equal(got, want), fqn
    assert store.verify(ckpt) == []


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("form", ["hf", "moezero"])
def test_export_streams(imported, tmp_path, dtype, form):
    ckpt, (_, model_bytes) = imported
    (growth,) = peak_growth(_EXPORT, ckpt / "step_00000000", tmp_path / "out", dtype, form)
    _budget_check(growth, model_bytes, f"export --format {form} {dtype}")
    _check_export(ckpt / "step_00000000", tmp_path / "out", dtype, form)


def _check_export(ckpt: Path, out: Path, dtype: str, form: str) -> None:
    """Every exported tensor equals the checkpoint's master cast to ``dtype``."""
    m = store.read_manifest(ckpt)
    family = family_for(arch_of(m), None) if form == "hf" else None
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    want_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    for fqn, shape in m.layout.shapes:
        key = hf_name(fqn, family) if family else fqn
        with safe_open(out / index[key], "pt") as f:
            got = f.get_tensor(key)
        want = torch.from_numpy(store.read_param(ckpt, m, fqn)).reshape(shape).to(want_dtype)
        assert got.dtype == want_dtype and torch.equal(got, want), key
