"""Qwen3.5-MoE's language model (docs/hf.md, "Qwen3.5-MoE") against transformers itself, no
downloads: tiny random ``Qwen3_5MoeForConditionalGeneration`` models (every tensor random, the
zero-centred gains too) whose layer mixes start and end with either kind, partial rotary 0.5
with interleaved multi-axis sections, plus bf16 multi-token-prediction tensors beside them.
Imported by ``import_hf``: text-only logits and every gradient within 1e-5 of transformers at
fp32 (chunks of 4 over 13 tokens); exported back and loaded by ``from_pretrained`` with no
missing or unexpected keys, the vision tower and ``mtp.*`` bit-identical, the same logits;
10 AdamW steps equal transformers + ``torch.optim.AdamW``; a PEFT export of LoRA on the
attention and the gated DeltaNet loads in ``peft`` with moezero's logits, and merged
(``--merge-lora``) loads with the vision tower unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moezero.checkpoint.hf import export_hf, import_hf
from moezero.checkpoint.hf.arch import arch_of
from moezero.checkpoint.hf.families import FAMILIES
from moezero.checkpoint.hf.names import candidates
from moezero.plan import store
from moezero.plan.store import CheckpointError
from tests.torch_impl.test_qwen3_next import (
    MIXES,
    SEQ,
    SMALL,
    TOKENS,
    decoder_of,
    projected,
    randomized,
    ten_adamw_steps,
)

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

TOL = 1e-5
TEXT = {k: v for k, v in SMALL.items() if k not in (
    "intermediate_size", "norm_topk_prob", "partial_rotary_factor")}
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "mrope_section": [1, 1, 0], "mrope_interleaved": True}
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4,
              out_hidden_size=32, num_position_embeddings=16, temporal_patch_size=2,
              spatial_merge_size=2)
MTP = {"mtp.fc.weight": (32, 64), "mtp.norm.weight": (32,)}


def hf_model(mix: str):
    """A tiny random Qwen3.5-MoE: every tensor N(0, 0.1²), the DeltaNet's output norm 1 ± 0.1."""
    cfg = transformers.Qwen3_5MoeConfig(
        text_config={**TEXT, "layer_types": MIXES[mix], "rope_parameters": ROPE},
        vision_config=VISION, image_token_id=90, video_token_id=91,
        vision_start_token_id=92, vision_end_token_id=93)
    torch.manual_seed(0)
    return randomized(transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval())


def save_with_mtp(model, path: Path) -> dict[str, torch.Tensor]:
    """``save_pretrained`` in shards, plus bf16 ``mtp.*`` tensors in a shard of their own and
    ``mtp_num_hidden_layers: 1`` (as the Hub's checkpoints have them); the mtp tensors."""
    model.save_pretrained(path, max_shard_size="50KB")
    gen = torch.Generator().manual_seed(5)
    mtp = {k: torch.randn(s, generator=gen).bfloat16() for k, s in MTP.items()}
    save_file(mtp, path / "mtp.safetensors")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return mtp


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{mix: (transformers model, its import, moezero's decoder, the mtp tensors, the root)}."""
    out = {}
    for mix in MIXES:
        root = tmp_path_factory.mktemp(mix)
        theirs = hf_model(mix)
        mtp = save_with_mtp(theirs, root / "hf")
        import_hf(root / "hf", root / "ckpt")
        out[mix] = theirs, root / "ckpt", decoder_of(root / "ckpt"), mtp, root
    return out


def test_text_rotary_is_the_plain_rotary():
    """Text positions (equal on every axis): the multi-axis, interleaved rotary's cos/sin are
    bit-equal to the plain partial rotary's (Qwen3-Next's, which moezero matches)."""
    text = transformers.Qwen3_5MoeTextConfig(**TEXT, rope_parameters=ROPE)
    plain = transformers.Qwen3NextConfig(**SMALL)
    x = torch.zeros(1, SEQ, 32)
    positions = torch.arange(SEQ)[None]
    multi = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTextRotaryEmbedding(
        text)(x, positions[None].expand(3, 1, -1))
    single = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRotaryEmbedding(
        plain)(x, positions)
    for a, b in zip(multi, single, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def hf_grad(params: dict, fqn: str, arch) -> torch.Tensor:
    """transformers' gradient of moezero's ``fqn``: the DeltaNet's fused projections built per
    key head from the separate ones (q, k, v, z rows; b, a rows)."""
    g, h = arch.linear_num_key_heads, arch.linear_num_value_heads
    k, v, r = arch.linear_key_head_dim, arch.linear_value_head_dim, h // g
    prefix = "model.language_model." + fqn.rsplit(".", 2)[0] + "."
    if fqn.endswith("in_proj_qkvz.weight"):
        q_, k_, v_ = params[prefix + "in_proj_qkv.weight"].grad.split([g * k, g * k, h * v])
        z_ = params[prefix + "in_proj_z.weight"].grad
        parts = [q_.view(g, k, -1), k_.view(g, k, -1), v_.view(g, r * v, -1), z_.view(g, r * v, -1)]
        return torch.cat(parts, dim=1).flatten(0, 1)
    if fqn.endswith("in_proj_ba.weight"):
        b_, a_ = (params[prefix + f"in_proj_{p}.weight"].grad.view(g, r, -1) for p in "ba")
        return torch.cat([b_, a_], dim=1).flatten(0, 1)
    key = candidates(fqn, arch, FAMILIES["qwen3_next"])[0][0]  # Qwen3-Next's on-disk name
    return params[key if key == "lm_head.weight" else "model.language_model." + key[6:]].grad


@pytest.mark.parametrize("mix", list(MIXES))
def test_import_logits_and_gradients_equal_transformers(models, mix):
    theirs, ckpt, ours, _, _ = models[mix]
    want, got = theirs(input_ids=TOKENS).logits, ours(TOKENS)[0]
    diff = (got - want).abs().max().item()
    print(f"logits max abs diff {diff:.3e} (max |logit| {want.abs().max():.3f})")
    assert diff <= TOL
    theirs.zero_grad(), ours.zero_grad()
    projected(want).backward(), projected(got).backward()
    arch = arch_of(store.read_manifest(store.find_checkpoint(ckpt)))
    params = dict(theirs.named_parameters())
    worst, f = 0.0, arch.ffn_dim
    for fqn, p in ours.named_parameters():
        if ".moe.experts." in fqn:  # transformers' fused experts [E, 2F, D], [E, D, F]
            layer, e, w = fqn.split(".")[1], int(fqn.split(".")[4]), fqn.split(".")[5]
            fused = params[f"model.language_model.layers.{layer}.mlp.experts."
                           + ("down_proj" if w == "w2" else "gate_up_proj")].grad[e]
            ref = {"w1": fused[:f], "w3": fused[f:], "w2": fused}[w]
        else:
            ref = hf_grad(params, fqn, arch).reshape(p.grad.shape)
        scale = max(ref.abs().max().item(), 1e-3)
        worst = max(worst, (p.grad - ref).abs().max().item() / scale)
        assert (p.grad - ref).abs().max() <= TOL * scale, fqn
    print(f"gradients: worst relative diff {worst:.2e}")


@pytest.mark.parametrize("mix", list(MIXES))
def test_export_loads_with_the_vision_tower_bit_identical(models, mix, tmp_path):
    theirs, ckpt, _, mtp, root = models[mix]
    export_hf(store.find_checkpoint(ckpt), tmp_path / "out")
    back, info = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert back.config.text_config.layer_types == theirs.config.text_config.layer_types
    source, exported = (json.loads((d / "config.json").read_text())
                        for d in (root / "hf", tmp_path / "out"))
    assert exported["vision_config"] == source["vision_config"]
    assert exported["text_config"]["mtp_num_hidden_layers"] == 1
    assert back.config.text_config.rope_parameters == theirs.config.text_config.rope_parameters
    want = theirs.state_dict()
    for key, value in back.state_dict().items():
        # a zero-centred gain w comes back as (1 + w) - 1: exact to an ulp of 1; the rest exact
        atol = 2 ** -23 if key.endswith("norm.weight") and "visual" not in key else 0.0
        torch.testing.assert_close(value, want[key], rtol=0, atol=atol, msg=key)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    for key, tensor in mtp.items():  # carried byte for byte, in their dtype
        with safe_open(tmp_path / "out" / index["weight_map"][key], "pt") as f:
            assert torch.equal(f.get_tensor(key).view(torch.int16), tensor.view(torch.int16))
    with torch.no_grad():
        diff = (back.eval()(input_ids=TOKENS).logits - theirs(input_ids=TOKENS).logits)
    assert diff.abs().max().item() <= TOL


def test_a_changed_carried_tower_is_refused_in_one_line(models, tmp_path):
    _, ckpt, _, _, root = models["full-ends"]
    carried = root / "ckpt" / "hf_carried" / "carried.safetensors"
    saved = carried.read_bytes()
    try:
        carried.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
        with pytest.raises(CheckpointError, match="changed since") as err:
            export_hf(store.find_checkpoint(ckpt), tmp_path / "out")
        assert "\n" not in str(err.value)
    finally:
        carried.write_bytes(saved)


def test_ten_steps_equal_transformers_with_adamw(models):
    """moezero's engine (W = 1, stage 0, fp32) and transformers + ``torch.optim.AdamW`` (the
    language model's parameters, no decay on gains and vectors) on the same batches: every
    step's loss within 1e-6."""
    theirs, ckpt, _, _, _ = models["linear-ends"]
    assert ten_adamw_steps(theirs, ckpt, skip="model.visual.") <= 1e-6


def test_a_text_config_that_is_not_an_object_is_one_line(models, tmp_path):
    _, _, _, _, root = models["full-ends"]
    config = json.loads((root / "hf" / "config.json").read_text())
    config["text_config"] = None
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="text_config") as err:
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert "\n" not in str(err.value)


def test_peft_export_of_attention_and_deltanet_loads_in_peft(models, tmp_path):
    """LoRA (r 4) on the gated attention, the gated DeltaNet and the routed experts, 2 steps through the CLI in
    this process; ``--format peft`` on the ``--format hf`` base loads in ``PeftModel`` with no
    missing or unexpected adapter keys and moezero's logits within 1e-5; ``--merge-lora``
    too, with the vision tower."""
    peft = pytest.importorskip("peft")
    from moezero.cli import main
    from tests.support.lora import lora_logits
    _, ckpt, _, _, _ = models["linear-ends"]
    run = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--config", str(ckpt / "config.yaml"),
                 "--set", "moe.ep_size=1", "--set", "peft.method=lora", "--set", "peft.r=4",
                 "--set", "peft.alpha=12", "--set", 'peft.targets=["attn","linear_attn","experts"]',
                 "--set", "model.gated_delta_chunk=4", "--set", "train.steps=2",
                 "--set", f"train.seq_len={SEQ}", "--set", "train.micro_batch_size=2",
                 "--set", "optimizer.lr=3e-2", "--set", "checkpoint.every=2",
                 "--out", str(run)]) == 0
    base, adapters = store.find_checkpoint(ckpt), store.find_checkpoint(run / "checkpoints")
    ours = lora_logits(base, adapters, TOKENS)
    assert main(["checkpoint", "export", str(base), "--format", "hf",
                 "--out", str(tmp_path / "hf_base")]) == 0
    assert main(["checkpoint", "export", str(adapters), "--format", "peft",
                 "--out", str(tmp_path / "peft")]) == 0
    hf_base = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        tmp_path / "hf_base").eval()
    with torch.no_grad():
        moved = (hf_base(input_ids=TOKENS).logits - ours).abs().max().item()
    assert moved > 1e-3, f"the adapters changed the logits by only {moved:.2e}"
    model = peft.PeftModel.from_pretrained(hf_base, tmp_path / "peft").eval()
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {"linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
            "linear_attn.in_proj_a", "linear_attn.out_proj", "self_attn.q_proj"} \
        <= set(config["target_modules"])
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} \
        <= set(config.get("target_parameters", [])), config  # the routed experts' adapters
    ours_keys = set(load_file(tmp_path / "peft" / "adapter_model.safetensors"))
    theirs = {k.replace(".default", "") for k in model.state_dict() if ".lora_" in k}
    assert ours_keys == theirs, ours_keys ^ theirs
    with torch.no_grad():
        diff = (model(input_ids=TOKENS).logits - ours).abs().max().item()
    print(f"peft: logits max abs diff {diff:.3e} (the adapters moved them {moved:.2e})")
    assert diff <= TOL
    assert main(["checkpoint", "export", str(adapters), "--merge-lora", "--format", "hf",
                 "--out", str(tmp_path / "merged")]) == 0
    merged, info = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        tmp_path / "merged", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        diff = (merged.eval()(input_ids=TOKENS).logits - ours).abs().max().item()
        vision = all(torch.equal(p, hf_base.state_dict()[k])
                     for k, p in merged.state_dict().items() if k.startswith("model.visual."))
    print(f"merged: logits max abs diff {diff:.3e}")
    assert diff <= TOL and vision
