"""DeepSeek-V3 (``model_type: deepseek_v3``: Kimi-K2, Moonlight; docs/hf.md) and the FP8
block-scaled checkpoints of the Hub, against transformers itself, no downloads.

FP8: a tiny checkpoint written from the format's definition (per 4x4 block, ``scale_inv =
amax / 448`` fp32 and ``fp8 = w / scale_inv`` in e4m3, in ``weight_scale_inv`` beside each
projection; embeddings, norms, router and head unquantized) imports to exactly transformers'
own dequantization (``Fp8Dequantize``), streamed in row ranges that cut blocks, and its logits
equal transformers' on the dequantized weights. A tiny random DeepSeek-V3 (latent attention
with and without ``q_lora_rank``, 4 expert groups of which 2 are chosen, a dense first layer,
2 shared experts, scaled gates, every tensor random) imports within 1e-5 of transformers'
logits, exports every tensor back and trains 10 AdamW steps as transformers + torch.optim.AdamW
do; these need the MLA attention kind (skipped without it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moezero.checkpoint.hf import export_hf, import_hf
from moezero.checkpoint.hf.fp8 import dequantize_rows
from moezero.checkpoint.hf.reader import HFTensors
from moezero.cli import main
from moezero.plan import store
from moezero.plan.reading import read_tensors
from tests.torch_impl.test_hf_families import TOKENS, VOCAB, assert_logits_close, moezero_logits
from tests.torch_impl.test_hf_glm4_moe import check_training, glm_model

transformers = pytest.importorskip("transformers")
from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # noqa: E402

BLOCK = (4, 4)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
UNQUANTIZED = ("embed_tokens", "norm", "layernorm", "lm_head", "mlp.gate.")


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's definition: per block, ``scale_inv = amax / 448`` and ``fp8 = w /
    scale_inv`` rounded to e4m3; the weight is ``fp8 · scale_inv``."""
    rows, cols = w.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.empty(grid)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = part.abs().max().clamp_min(1e-12) / FP8_MAX
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (
                part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def fp8_folder(model, root: Path) -> tuple[Path, dict]:
    """``model`` saved as the Hub's FP8 checkpoints are (one file, per-expert tensors), and
    transformers' own dequantization of every quantized weight, by key."""
    model.save_pretrained(root / "plain")
    state = load_file(root / "plain" / "model.safetensors")
    out, expected = {}, {}
    for key, value in state.items():
        if value.ndim != 2 or any(part in key for part in UNQUANTIZED):
            out[key] = value
            continue
        out[key], out[key + "_scale_inv"] = quantize(value, BLOCK)
        expected[key] = Fp8Dequantize(None)._dequantize_one(
            out[key], out[key + "_scale_inv"], output_dtype=torch.float32)
    (root / "fp8").mkdir()
    save_file(out, root / "fp8" / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((root / "plain" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    (root / "fp8" / "config.json").write_text(json.dumps(cfg))
    return root / "fp8", expected


def check_fp8_import(folder: Path, expected: dict, cls, root: Path) -> Path:
    """Import the FP8 ``folder``: its export holds transformers' dequantized weights bit for
    bit (the others as saved), and moezero's logits are transformers' on them. Returns the
    imported step."""
    step = import_hf(folder, root / "ckpt")
    exported = export_hf(step, root / "export")[0].parent  # per-expert keys, fp32
    back = load_file(exported / "model.safetensors")
    assert expected and all(torch.equal(back[k], v) for k, v in expected.items())
    plain = load_file(folder.parent / "plain" / "model.safetensors")
    assert all(torch.equal(back[k], plain[k]) for k in plain if k not in expected)
    theirs = cls.from_pretrained(exported).eval()  # transformers on the dequantized weights
    with torch.no_grad():
        assert_logits_close(moezero_logits(root / "ckpt"), theirs(TOKENS).logits, "fp8 import")
    return step


@pytest.fixture(scope="module")
def glm_fp8(tmp_path_factory) -> tuple[Path, dict]:
    """A tiny GLM-4.5 as an FP8 checkpoint, and transformers' dequantization of it."""
    return fp8_folder(glm_model(), tmp_path_factory.mktemp("glm_fp8"))


def test_fp8_import_is_transformers_dequantization_bit_for_bit(glm_fp8, tmp_path):
    folder, expected = glm_fp8
    step = check_fp8_import(folder, expected, transformers.Glm4MoeForCausalLM, tmp_path)
    tensors = read_tensors(step, store.read_manifest(step))  # the checkpoint itself, by FQN
    assert torch.equal(torch.from_numpy(tensors["layers.1.attn.wq.weight"]),
                       expected["model.layers.1.self_attn.q_proj.weight"])


def test_fp8_rows_stream_across_partial_blocks(tmp_path):
    """Row ranges that cut blocks, on a weight whose shape is not a multiple of the block
    (the last blocks partial, as DeepSeek's 576-row kv_a_proj_with_mqa): each element is its
    fp8 value times its block's scale."""
    w = torch.randn(21, 11, generator=torch.Generator().manual_seed(4))
    q, scale = quantize(w, (8, 4))
    save_file({"w.weight": q, "w.weight_scale_inv": scale}, tmp_path / "model.safetensors")
    tensors = HFTensors(tmp_path, fp8_block=(8, 4))
    parts = [tensors.read_rows("w.weight", (), slice(a, b)) for a, b in ((0, 5), (5, 13), (13, 21))]
    rows = torch.arange(21)[:, None] // 8
    cols = torch.arange(11)[None, :] // 4
    assert torch.equal(torch.cat(parts), q.float() * scale[rows, cols])
    assert torch.equal(dequantize_rows(q[9:10], scale[1:2], 9, (8, 4)), q[9:10].float() * scale[1, cols])


@pytest.mark.parametrize("change, line", [
    ({"weight_block_size": [128]}, "quantization_config.weight_block_size=[128]"),
    ({"fmt": "e5m2"}, "moezero reads fp8 e4m3 weights"),
    ({"weight_block_size": [8, 8]}, "scale_inv has shape"),
])
def test_fp8_problems_are_one_line(glm_fp8, tmp_path, capsys, change, line):
    src = tmp_path / "fp8"
    src.mkdir()
    for f in glm_fp8[0].iterdir():
        (src / f.name).symlink_to(f)
    cfg = json.loads((glm_fp8[0] / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (src / "config.json").unlink()
    (src / "config.json").write_text(json.dumps(cfg))
    assert main(["import-hf", str(src), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
    assert not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------------------------ deepseek_v3

MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
              n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
              norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 5e5}, **MLA)


def deepseek_model(**changes):
    pytest.importorskip("moezero.model.mla")  # the attention kind (helper mla's branch)
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**{**CONFIG, **changes})
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + noise if name.endswith(("norm.weight", "layernorm.weight")) else noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


@pytest.mark.parametrize("changes", [{"q_lora_rank": 16, "attention_bias": True},
                                     {"q_lora_rank": None, "rope_interleave": False}],
                         ids=["q-lora-bias", "plain-q-halves"])
def test_deepseek_v3_imports_and_exports_exactly(tmp_path, changes):
    theirs = deepseek_model(**changes)
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="50KB")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    with torch.no_grad():
        source = theirs(TOKENS).logits
    assert_logits_close(moezero_logits(tmp_path / "ckpt"), source, "deepseek_v3 import")
    export_hf(store.find_checkpoint(tmp_path / "ckpt"), tmp_path / "out")
    back, info = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out",
                                                                    output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    mine = back.state_dict()
    assert mine.keys() == theirs.state_dict().keys()
    assert all(torch.equal(mine[k], v) for k, v in theirs.state_dict().items())
    with torch.no_grad():
        assert_logits_close(back.eval()(TOKENS).logits, source, "deepseek_v3 export")


def test_deepseek_v3_ten_adamw_steps_equal_transformers_and_torch_adamw(tmp_path):
    """Losses within 1e-6, weights within 1e-5 norm-wise (``check_training``: element by
    element, Adam makes one w2 element's fp32 rounding near its eps 1.49e-5 of the tensor's
    largest, as transformers' eager attention against its sdpa makes it 9.9e-6)."""
    theirs = deepseek_model(q_lora_rank=16, attention_bias=True)
    theirs.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    check_training(transformers.DeepseekV3ForCausalLM, tmp_path / "hf", tmp_path / "ckpt",
                   "deepseek_v3", CONFIG["moe_intermediate_size"])


def test_deepseek_v3_fp8_import(tmp_path):
    folder, expected = fp8_folder(deepseek_model(q_lora_rank=16), tmp_path / "hf")
    check_fp8_import(folder, expected, transformers.DeepseekV3ForCausalLM, tmp_path)


YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 4, "mscale": 0.8, "mscale_all_dim": 0.6}
"""DeepSeek-V3's YaRN (both mscales, the ramp inside the 4 rotary dims at these lengths)."""


@pytest.mark.parametrize("changes", [{"q_lora_rank": 16, "rope_parameters": YARN}],
                         ids=["yarn"])
def test_deepseek_v3_yarn_imports_and_exports_exactly(tmp_path, changes):
    """YaRN's frequencies and cos/sin factor on the rotary dims and mscale_all_dim's softmax
    factor (model.mla_mscale), as transformers computes them; written back as it was."""
    theirs = deepseek_model(**changes)
    theirs.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    with torch.no_grad():
        source = theirs(TOKENS).logits
    assert_logits_close(moezero_logits(tmp_path / "ckpt"), source, "deepseek_v3 yarn import")
    export_hf(store.find_checkpoint(tmp_path / "ckpt"), tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]
    assert {k: written[k] for k in YARN} == YARN, written
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert_logits_close(back(TOKENS).logits, source, "deepseek_v3 yarn export")
