"""Qwen3-Next (docs/hf.md) against transformers itself, no downloads: tiny random models whose
layer mixes start and end with either kind (gated DeltaNet, gated attention), partial rotary
0.5, imported by ``import_hf``: logits and every gradient within 1e-5 of transformers at fp32
(chunks of 4 over 13 tokens); exported back and loaded by ``from_pretrained`` with no missing
or unexpected keys, the same tensors; a packed row with a document mask equals each document
alone; and what moezero refuses, in one line.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moezero.checkpoint.hf import export_hf, import_hf
from moezero.checkpoint.hf.arch import arch_of
from moezero.checkpoint.hf.families import FAMILIES, family_for
from moezero.checkpoint.hf.names import candidates
from moezero.config import Config
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.model.build import config_decoder
from moezero.plan import store
from moezero.plan.rules import weight_decay_applies
from moezero.plan.store import CheckpointError
from tests.support.hf import save_hf

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

TOL = 1e-5
VOCAB, SEQ = 96, 13
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
             linear_conv_kernel_dim=3, moe_intermediate_size=16,
             shared_expert_intermediate_size=12, intermediate_size=12, num_experts=4,
             num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
             partial_rotary_factor=0.5, max_position_embeddings=128)
MIXES = {"linear-ends": ["linear_attention", "full_attention", "linear_attention"],
         "full-ends": ["full_attention", "linear_attention", "full_attention"]}


def hf_model(mix: str, **overrides):
    """A tiny random Qwen3-Next, every tensor random: its zero-centred gains N(0, 0.1²), the
    gated DeltaNet's output norm 1 ± 0.1, everything else N(0, 0.1²) (as test_hf_families)."""
    cfg = transformers.Qwen3NextConfig(**{**SMALL, "layer_types": MIXES[mix], **overrides})
    torch.manual_seed(0)
    return randomized(transformers.Qwen3NextForCausalLM(cfg).eval())


def randomized(model):
    """``model`` with every tensor N(0, 0.1²) (Qwen3-Next's gains are zero-centred), the gated
    DeltaNet's output norm 1 ± 0.1 (generator seeded 2). Qwen3.5-MoE's tests use it too."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("linear_attn.norm.weight") else
                    0.1 * noise)
    return model


@pytest.fixture(scope="module", params=list(MIXES))
def imported(request, tmp_path_factory):
    """(transformers model, its import, moezero's decoder of the import)."""
    root = tmp_path_factory.mktemp(request.param)
    theirs = hf_model(request.param)
    import_hf(save_hf(theirs, root / "hf"), root / "ckpt")
    return theirs, root / "ckpt", decoder_of(root / "ckpt")


def decoder_of(ckpt: Path, chunk: int = 4):
    manifest = store.read_manifest(store.find_checkpoint(ckpt))
    cfg = Config.model_validate(manifest.config)
    cfg.moe.ep_size, cfg.model.gated_delta_chunk = 1, chunk
    cfg.moe.aux_loss_coef = cfg.moe.z_loss_coef = 0.0
    model = config_decoder(cfg, where="cpu", init=False)
    tensors = store.read_tensors(store.find_checkpoint(ckpt), manifest)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
    return model


def projected(logits: torch.Tensor) -> torch.Tensor:
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    return (logits * weights).sum()


def test_import_logits_and_gradients_equal_transformers(imported):
    theirs, ckpt, ours = imported
    want, got = theirs(TOKENS).logits, ours(TOKENS)[0]
    diff = (got - want).abs().max().item()
    print(f"logits max abs diff {diff:.3e} (max |logit| {want.abs().max():.3f})")
    assert diff <= TOL
    theirs.zero_grad(), ours.zero_grad()
    projected(want).backward(), projected(got).backward()
    arch, family = arch_of(store.read_manifest(store.find_checkpoint(ckpt))), FAMILIES["qwen3_next"]
    hf_params = dict(theirs.named_parameters())
    for fqn, p in ours.named_parameters():
        key, index = next((k, i) for k, i in candidates(fqn, arch, family) if k in hf_params)
        ref = hf_params[key].grad[index] if index else hf_params[key].grad
        ref = ref.reshape(p.grad.shape)
        assert (p.grad - ref).abs().max() <= TOL * max(ref.abs().max(), 1e-3), fqn


def test_export_loads_in_transformers_unchanged(imported, tmp_path):
    theirs, ckpt, _ = imported
    export_hf(store.find_checkpoint(ckpt), tmp_path / "out")
    back, info = transformers.Qwen3NextForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert back.config.layer_types == theirs.config.layer_types
    assert back.config.rope_parameters["partial_rotary_factor"] == 0.5
    want = theirs.state_dict()
    for key, value in back.state_dict().items():
        # a zero-centred gain w comes back as (1 + w) - 1: exact to an ulp of 1
        atol = 2 ** -23 if key.endswith("norm.weight") else 0.0
        torch.testing.assert_close(value, want[key], rtol=0, atol=atol, msg=key)
    with torch.no_grad():
        diff = (back.eval()(TOKENS).logits - theirs(TOKENS).logits).abs().max().item()
    assert diff <= TOL


def test_packed_row_equals_documents_alone(imported):
    _, _, ours = imported
    lengths = (6, 1, 6)
    labels = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = ours(TOKENS[:1], labels)[0]
        alone = torch.cat([ours(part)[0] for part in TOKENS[:1].split(lengths, dim=1)], dim=1)
    diff = (packed - alone).abs().max().item()
    print(f"packed vs alone: max abs diff {diff:.3e}")
    assert diff <= TOL


@pytest.mark.parametrize("field, value", [
    ("mlp_only_layers", [1]), ("decoder_sparse_step", 2), ("mtp_num_hidden_layers", 1),
    ("layer_types", ["linear_attention", "sliding_attention", "full_attention"])])
def test_unsupported_fields_are_one_line(tmp_path, field, value):
    theirs = hf_model("full-ends")
    save_hf(theirs, tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    with pytest.raises(CheckpointError, match=field) as err:
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert "\n" not in str(err.value)


def test_mtp_tensors_are_refused_in_one_line(tmp_path):
    from safetensors.torch import save_file
    theirs = hf_model("full-ends")
    theirs.config.save_pretrained(tmp_path / "hf")
    state = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    save_file({**state, "mtp.fc.weight": torch.zeros(4, 4)}, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(CheckpointError, match="mtp.fc.weight") as err:
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert "\n" not in str(err.value)


def test_other_families_refuse_the_hybrid_layers(imported):
    _, ckpt, _ = imported
    arch = arch_of(store.read_manifest(store.find_checkpoint(ckpt)))
    assert family_for(arch).model_type == "qwen3_next"
    for other in ("qwen3_moe", "qwen2_moe", "mixtral"):
        with pytest.raises(CheckpointError, match="gated_delta_layers|partial_rotary|output_gate"):
            family_for(arch, other)


def test_ten_steps_equal_transformers_with_adamw(imported):
    """moezero's engine (W = 1, stage 0, fp32) and transformers + ``torch.optim.AdamW`` with
    the same groups (no decay on gains and vectors), lr, betas and eps, on the same batches:
    every step's loss within 1e-6."""
    theirs, ckpt, _ = imported
    assert ten_adamw_steps(theirs, ckpt) <= 1e-6


def ten_adamw_steps(theirs, ckpt: Path, skip: str = "\0") -> float:
    """The worst loss difference over 10 steps of moezero's engine (W = 1, stage 0) on
    ``ckpt`` and of transformers' ``theirs`` (its parameters but those named from ``skip``)
    with ``torch.optim.AdamW`` in the same groups, on the same batches."""

    cfg = train_config(ckpt)
    engine = initialize(decoder_of(ckpt), cfg, topology=build_topology([1], num_experts=4),
                        device="cpu")
    hf = copy.deepcopy(theirs).train()
    named = [(n, p) for n, p in hf.named_parameters() if not n.startswith(skip)]
    decay = [p for n, p in named if weight_decay_applies(n, p.shape)]
    rest = [p for n, p in named if not weight_decay_applies(n, p.shape)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.optimizer.lr, betas=cfg.optimizer.betas,
                            eps=cfg.optimizer.eps, weight_decay=cfg.optimizer.weight_decay)
    gen = torch.Generator().manual_seed(9)
    worst = 0.0
    for _ in range(10):
        batch = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
        ours = engine.train_step([batch])["loss"]
        logits = hf(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        worst = max(worst, abs(ours - loss.item()))
    print(f"10 steps: worst loss diff {worst:.2e}")
    return worst


def train_config(ckpt: Path) -> Config:
    manifest = store.read_manifest(store.find_checkpoint(ckpt))
    data = manifest.config
    data["model"]["gated_delta_chunk"] = 4
    data["moe"].update(ep_size=1, aux_loss_coef=0.0, z_loss_coef=0.0)
    data["optimizer"].update(lr=1e-3, weight_decay=0.1, gradient_clipping=None, warmup_steps=0,
                             min_lr_ratio=1.0)
    data["train"].update(micro_batch_size=2, seq_len=SEQ, grad_accum_steps=1, steps=10)
    data["precision"]["dtype"] = "fp32"
    data["zero_optimization"]["stage"] = 0
    data["checkpoint"]["load"] = None
    return Config.model_validate(data)
