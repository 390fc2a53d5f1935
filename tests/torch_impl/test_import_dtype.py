"""``moezero import-hf --dtype`` (docs/hf.md, "Import"): a weights-only import keeps the
source's dtype by default. A bf16 Hugging Face model imported as bf16 holds 2 B per parameter,
and every reader upcasts it exactly: its masters equal the fp32 import's bit for bit (read
whole, by a full fine-tune at stage 2 and at stage 3 with the optimizer on NVMe, and in an
export), and both equal the transformers model's own bf16 weights upcast.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moezero.checkpoint.tools import describe
from moezero.cli import main
from moezero.plan import store
from tests.support.hf import save_hf
from tests.support.world import run_world
from tests.torch_impl.test_distributed import MICRO
from tests.torch_impl.test_hf_families import hf_model
from tests.torch_impl.test_zero import engine_and_batches

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    """A tiny random Qwen3-MoE in bf16, imported by default (bf16), as fp32 and as fp16."""
    root = tmp_path_factory.mktemp("import_dtype")
    model = hf_model("qwen3_moe").to(torch.bfloat16)
    src = save_hf(model, root / "hf")
    out = {"hf": {k: v.float().numpy() for k, v in model.state_dict().items()}}
    for name, extra in (("default", []), ("fp32", ["--dtype", "fp32"]),
                        ("fp16", ["--dtype", "fp16"])):
        assert main(["import-hf", str(src), "--out", str(root / name), *extra]) == 0
        out[name] = store.find_checkpoint(root / name)
    return out


def _data_bytes(step) -> int:
    m = store.read_manifest(step)
    return sum(f.data_size for f in m.layout.model_files)


def test_the_default_keeps_the_sources_bf16_at_half_the_bytes(imports):
    numel = sum(math.prod(s) for _, s in store.read_manifest(imports["fp32"]).layout.shapes)
    assert store.read_manifest(imports["default"]).layout.dtype == "BF16"
    assert store.read_manifest(imports["fp32"]).layout.dtype == "F32"
    assert _data_bytes(imports["default"]) == 2 * numel
    assert _data_bytes(imports["fp32"]) == 4 * numel
    assert store.verify(imports["default"]) == [] and store.verify(imports["fp16"]) == []
    text = describe(imports["default"])
    assert f"bf16 weights only (no optimizer state) {2 * numel:,} (2 B x {numel:,})" in text


def _bits(tensors: dict) -> dict:
    return {k: np.ascontiguousarray(v, np.float32).view(np.uint32) for k, v in tensors.items()}


def test_bf16_masters_are_the_fp32_imports_bit_for_bit_and_the_sources_upcast(imports):
    read = {n: store.read_tensors(imports[n], store.read_manifest(imports[n]))
            for n in ("default", "fp32", "fp16")}
    bf16, fp32 = _bits(read["default"]), _bits(read["fp32"])
    assert bf16.keys() == fp32.keys()
    for fqn in fp32:
        assert np.array_equal(bf16[fqn], fp32[fqn]), fqn
        assert np.array_equal(read["fp16"][fqn],
                              read["fp32"][fqn].astype(np.float16).astype(np.float32)), fqn
    # the source of truth: the transformers model's own tensors (the embedding, a norm gain)
    hf = imports["hf"]
    assert np.array_equal(read["default"]["embed.weight"], hf["model.embed_tokens.weight"])
    assert np.array_equal(read["default"]["norm.weight"], hf["model.norm.weight"])


def test_an_export_of_the_bf16_import_is_the_fp32_imports(imports, tmp_path):
    for name in ("default", "fp32"):
        assert main(["checkpoint", "export", str(imports[name]), "--format", "hf",
                     "--out", str(tmp_path / name)]) == 0
    for f in sorted(p.name for p in (tmp_path / "fp32").glob("*.safetensors")):
        assert (tmp_path / "default" / f).read_bytes() == (tmp_path / "fp32" / f).read_bytes()


def _finetune(cfgs: dict) -> dict:
    """Per case: a full fine-tune at W = 1 loading its import; full params, two losses."""
    out = {}
    for name, cfg in cfgs.items():
        engine, _, batches = engine_and_batches(cfg, 1)
        engine.load_checkpoint(cfg["checkpoint"]["load"])
        loaded = {k: p.detach().float().clone().numpy()
                  for k, p in engine.full_parameters().items()}
        losses = [engine.train_step(list(torch.from_numpy(batches.next()).split(MICRO)))["loss"]
                  for _ in range(2)]
        out[name] = {"loaded": loaded, "losses": losses}
        engine.close()
    return out


def _cfg(step, stage: int, nvme: str | None) -> dict:
    cfg = dict(store.read_manifest(step).config)
    cfg["moe"] = {**cfg["moe"], "ep_size": 1}
    cfg["train"] = {**cfg["train"], "seq_len": 16, "micro_batch_size": MICRO}
    cfg["precision"] = {**cfg["precision"], "dtype": "fp32"}
    device = "nvme" if nvme else "none"
    cfg["zero_optimization"] = {**cfg["zero_optimization"], "stage": stage,
                                "offload_optimizer": {"device": device, "nvme_path": nvme},
                                "offload_param": {"device": device if stage == 3 else "none",
                                                  "nvme_path": nvme if stage == 3 else None}}
    cfg["checkpoint"] = {**cfg["checkpoint"], "load": str(step)}
    return cfg


def test_a_full_finetune_from_the_bf16_import_starts_from_the_exact_upcasts(imports, tmp_path):
    nvme = str(tmp_path / "swap")
    (tmp_path / "swap").mkdir()
    cases = {f"{name}_s{stage}": _cfg(imports[name], stage, nvme if stage == 3 else None)
             for name in ("default", "fp32") for stage in (2, 3)}
    (res,) = run_world(_finetune, 1, tmp_path, cases, timeout_s=240)
    for stage in (2, 3):
        bf16, fp32 = res[f"default_s{stage}"], res[f"fp32_s{stage}"]
        assert bf16["losses"] == fp32["losses"]
        for fqn, value in fp32["loaded"].items():
            assert np.array_equal(bf16["loaded"][fqn].view(np.uint32), value.view(np.uint32))
