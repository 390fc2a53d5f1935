"""GLM-4.5 (``model_type: glm4_moe``, docs/hf.md) against transformers itself, no downloads: a
tiny random model from its transformers 5 config (every tensor random, the correction biases and
norm gains included; 4 expert groups of which 2 are chosen, a dense first layer, 2 shared
experts, partial rotary, q/k/v biases, QK-norm, scaled gates) is imported (logits within 1e-5)
and exported back (every tensor equal, the biases fp32 at bf16 too); 10 AdamW steps of moezero
equal transformers + ``torch.optim.AdamW`` on the same batches; a LoRA run's PEFT export loads
in ``peft`` with moezero's logits. The multi-token-prediction layers are dropped with a note.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moezero.checkpoint.hf import export_hf, import_hf
from moezero.cli import main
from moezero.config import Config
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.model.build import config_decoder
from moezero.plan import rules, store
from moezero.plan.reading import read_tensors
from moezero.train import train
from tests.support.compare import rel_err
from tests.torch_impl.test_hf_families import TOKENS, VOCAB, assert_logits_close, moezero_logits

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

EXPERTS, STEPS, LR = 8, 10, 1e-3
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              n_routed_experts=EXPERTS, num_experts_per_tok=3, n_group=4, topk_group=2,
              n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
              norm_topk_prob=True, use_qk_norm=True, attention_bias=True, rms_norm_eps=1e-6,
              max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                               "partial_rotary_factor": 0.5})


def glm_model() -> torch.nn.Module:
    """Every parameter random (gains 1 ± 0.1, the rest N(0, 0.1²)) and every correction bias
    N(0, 0.05²), so each shows in the logits and the routing."""
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**CONFIG)).eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(transformers model, its folder, the imported checkpoint root)."""
    root = tmp_path_factory.mktemp("glm")
    model = glm_model()
    model.save_pretrained(root / "hf", max_shard_size="50KB")
    import_hf(root / "hf", root / "ckpt")
    return model, root / "hf", root / "ckpt"


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def test_import_equals_transformers_and_export_gives_every_tensor_back(made, tmp_path):
    theirs, hf_dir, ckpt = made
    cfg = Config.model_validate(json.loads(
        (store.find_checkpoint(ckpt) / "manifest.json").read_text())["config"])
    assert (cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.routed_scaling_factor) == (4, 2, 2.5)
    assert (cfg.moe.shared_ffn_dim, cfg.model.first_k_dense, cfg.model.dense_ffn_dim) == (24, 1, 40)
    assert cfg.model.partial_rotary_factor == 0.5 and cfg.moe.expert_bias
    assert_logits_close(moezero_logits(ckpt), logits(theirs), "glm4_moe import")

    export_hf(store.find_checkpoint(ckpt), tmp_path / "out")
    back, info = transformers.Glm4MoeForCausalLM.from_pretrained(tmp_path / "out",
                                                                 output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    mine, source = back.state_dict(), theirs.state_dict()
    assert mine.keys() == source.keys()
    for key, value in source.items():
        assert torch.equal(mine[key], value), key  # fp32 both ways: exact
    assert_logits_close(logits(back.eval()), logits(theirs), "glm4_moe export")
    export_hf(store.find_checkpoint(ckpt), tmp_path / "bf16", dtype="bf16")
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        key = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert f.get_slice(key).get_dtype() == "F32"
        assert f.get_slice("model.layers.1.mlp.gate.weight").get_dtype() == "BF16"


def test_multi_token_prediction_layers_are_dropped_with_a_note(made, tmp_path, capsys):
    _, hf_dir, _ = made
    src = tmp_path / "hf"
    src.mkdir()
    for f in hf_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    extra = {"model.layers.3.eh_proj.weight": torch.ones(32, 64),
             "model.layers.3.mlp.experts.0.gate_proj.weight": torch.ones(12, 32)}
    save_file(extra, src / "mtp.safetensors")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(extra, "mtp.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["import-hf", str(src), "--out", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "dropped the 1 multi-token-prediction layer(s) (num_nextn_predict_layers=1" in out
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    assert main(["import-hf", str(src), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert "tensor model.layers.3.eh_proj.weight has no place in moezero's decoder" in err


def hf_step_loop(model, batches) -> list[float]:
    """transformers' model trained by ``torch.optim.AdamW``: decay on matrices, not on norm
    gains and biases (moezero's ``weight_decay_applies``), constant lr, no clipping."""
    model.train()
    named = list(model.named_parameters())
    decay = [p for n, p in named if rules.weight_decay_applies(n, p.shape)]
    rest = [p for n, p in named if not rules.weight_decay_applies(n, p.shape)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for batch in batches:
        out = model(batch[:, :-1]).logits
        loss = F.cross_entropy(out.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def moezero_loop(ckpt: Path, batches) -> tuple[list[float], dict]:
    """moezero's engine (W = 1, ZeRO 0, fp32) from the import: the same batches, no aux or z
    loss, the expert biases not updated (transformers does not), lr constant, no clipping."""
    cfg = Config.model_validate(json.loads(
        (store.find_checkpoint(ckpt) / "manifest.json").read_text())["config"])
    cfg.moe.ep_size, cfg.moe.aux_loss_coef, cfg.moe.z_loss_coef = 1, 0.0, 0.0
    cfg.moe.bias_update_rate = 0.0
    cfg.optimizer = cfg.optimizer.model_copy(update={
        "lr": LR, "betas": (0.9, 0.95), "weight_decay": 0.1, "gradient_clipping": None,
        "warmup_steps": 0, "min_lr_ratio": 1.0})
    cfg.train.steps, cfg.precision.dtype, cfg.zero_optimization.stage = STEPS, "fp32", 0
    model = config_decoder(cfg, where="cpu", init=False)
    engine = initialize(model, cfg, topology=build_topology([1], num_experts=EXPERTS),
                        device="cpu")
    engine.load_checkpoint(store.find_checkpoint(ckpt))
    losses = [engine.train_step([batch])["loss"] for batch in batches]
    return losses, {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def check_training(cls, hf_dir: Path, ckpt: Path, model_type: str, ffn: int) -> None:
    """10 steps on two batches in turn: every loss within 1e-6 (relative and absolute) of
    transformers' + ``torch.optim.AdamW``'s, every tensor within 1e-5 (``||a − b|| / ||b||``,
    the suite's relative error) at the end.

    Norm-wise, not element by element: where a gradient element is near Adam's eps, Adam turns
    fp32 rounding of it into a step of a sizeable fraction of lr. DeepSeek-V3 here: the first
    gradient of w2[2, 3] of layer 2's expert 6 is 8.99e-8 in transformers (sdpa) and 9.44e-8
    in moezero (its row's largest is 1.9e-2: a cancellation, equal to 2.4e-7 of that), so the
    first steps ``lr·g/(|g| + eps)`` differ by 4.34e-6, which is the whole final difference
    there (1.49e-5 of the tensor's largest; norm-wise 2.0e-6). transformers against itself with
    eager attention instead of sdpa (the same math, another order; first gradients as close as
    moezero's, 1.1e-6 norm-wise) differs there by 2.87e-6 at the first step and ends 9.9e-6
    element-wise (norm-wise 1.3e-6) on the same tensor."""
    gen = torch.Generator().manual_seed(3)
    pair = [torch.randint(0, VOCAB, (2, 13), generator=gen) for _ in range(2)]
    batches = pair * (STEPS // 2)  # two batches in turn: the loss on each falls
    theirs = cls.from_pretrained(hf_dir)
    their_losses = hf_step_loop(theirs, batches)
    losses, state = moezero_loop(ckpt, batches)
    print(f"{model_type}: losses {losses[0]:.4f} -> {losses[-1]:.4f}, max abs diff "
          f"{max(abs(a - b) for a, b in zip(losses, their_losses, strict=True)):.2e}")
    for step, (a, b) in enumerate(zip(losses, their_losses, strict=True), start=1):
        assert abs(a - b) <= 1e-6 * min(1.0, abs(b)), f"step {step}: loss {a} vs {b}"
    assert their_losses[-2] < their_losses[0] - 0.1  # it trains
    trained = theirs.state_dict()
    errors = {fqn: rel_err(value, trained[_hf_key(fqn, model_type, ffn)[0]][
        _hf_key(fqn, model_type, ffn)[1]]) for fqn, value in state.items()}
    worst = max(errors, key=errors.get)
    print(f"{model_type} weights: worst ||a - b|| / ||b|| {errors[worst]:.2e} ({worst})")
    assert errors[worst] <= 1e-5, f"{worst}: relative error {errors[worst]:.2e}"


def test_ten_adamw_steps_equal_transformers_and_torch_adamw(made):
    _, hf_dir, ckpt = made
    check_training(transformers.Glm4MoeForCausalLM, hf_dir, ckpt, "glm4_moe",
                   CONFIG["moe_intermediate_size"])


def _hf_key(fqn: str, model_type: str, ffn: int) -> tuple[str, tuple]:
    """The transformers 5 in-memory tensor (fused experts) and index holding ``fqn``."""
    from moezero.checkpoint.hf import FAMILIES, hf_name

    parts = fqn.split(".")
    if ".moe.experts." in fqn:
        layer, e, w = parts[1], int(parts[4]), parts[5]
        key = f"model.layers.{layer}.mlp.experts." + ("down_proj" if w == "w2" else "gate_up_proj")
        rows = {"w1": slice(0, ffn), "w3": slice(ffn, 2 * ffn), "w2": slice(None)}[w]
        return key, (e, rows)
    return hf_name(fqn, FAMILIES[model_type]), ()


def test_lora_run_exports_as_peft_that_peft_loads(made, tmp_path, capsys):
    _, hf_dir, ckpt = made
    cfg = Config.model_validate(json.loads(
        (store.find_checkpoint(ckpt) / "manifest.json").read_text())["config"])
    cfg.moe.ep_size, cfg.moe.bias_update_rate = 1, 0.0
    cfg.peft = cfg.peft.model_copy(update={"method": "lora", "r": 4, "alpha": 8.0,
                                           "targets": ["attn", "shared", "experts", "mlp"]})
    cfg.train = cfg.train.model_copy(update={"steps": 2, "seq_len": 12, "micro_batch_size": 2,
                                             "eval_every": 0, "log_every": 100})
    cfg.optimizer.lr, cfg.checkpoint.every = 3e-2, 0
    train(Config.model_validate(cfg.model_dump(by_alias=True)), str(tmp_path / "run"))
    adapters = store.find_checkpoint(tmp_path / "run" / "checkpoints")
    base = store.find_checkpoint(ckpt)
    assert main(["checkpoint", "export", str(base), "--format", "hf",
                 "--out", str(tmp_path / "base")]) == 0
    assert main(["checkpoint", "export", str(adapters), "--format", "peft",
                 "--out", str(tmp_path / "peft")]) == 0
    model_cfg = Config.model_validate(store.read_manifest(adapters).config)
    model_cfg.moe.ep_size = 1
    ours_model = config_decoder(model_cfg, where="cpu", init=False).eval()
    state = {**read_tensors(base, store.read_manifest(base)),
             **read_tensors(adapters, store.read_manifest(adapters))}
    ours_model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    with torch.no_grad():
        ours = ours_model(TOKENS)[0]
    hf_base = transformers.Glm4MoeForCausalLM.from_pretrained(tmp_path / "base").eval()
    assert (logits(hf_base) - ours).abs().max() > 1e-3  # the adapters do change the logits
    model = peft.PeftModel.from_pretrained(hf_base, tmp_path / "peft").eval()
    saved = set(load_file(tmp_path / "peft" / "adapter_model.safetensors"))
    loaded = {k.replace(".default", "") for k in model.state_dict() if ".lora_" in k}
    assert saved == loaded, saved ^ loaded
    assert any(".mlp.shared_experts." in k for k in saved)
    assert any("layers.0.mlp.gate_proj" in k for k in saved)  # the dense layer's
    assert_logits_close(logits(model), ours, "glm4_moe peft")


def test_peft_export_refuses_expert_biases_that_moved(made):
    """A PEFT adapter holds no buffers: an adapter checkpoint whose expert biases differ from
    its base's (a LoRA run with moe.bias_update_rate > 0) is refused in one line naming one."""
    from moezero.checkpoint.hf.peft_export import _refuse_moved_buffers
    from moezero.plan.store import CheckpointError

    base = store.find_checkpoint(made[2])
    trained = {k: torch.from_numpy(v) for k, v in
               read_tensors(base, store.read_manifest(base)).items()}
    _refuse_moved_buffers(base, trained, base)  # unchanged: fine
    trained["layers.2.moe.router.expert_bias"][3] += 1e-3
    with pytest.raises(CheckpointError, match=r"the expert bias layers.2.moe.router.expert_bias "
                                              r"moved in the LoRA run .* --merge-lora"):
        _refuse_moved_buffers(base, trained, base)
