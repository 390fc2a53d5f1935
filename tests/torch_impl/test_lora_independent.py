"""An independent check of LoRA with ``train.freeze`` "!" patterns (issue 38, "done when"): a
plain transformers + peft + ``torch.optim.AdamW`` loop, written here without moezero's model,
trains the same tiny random Mixtral (gains 1 ± 0.1, every weight random) on the same batches
as moezero's engine: LoRA on the attention projections (peft's ``LoraConfig`` on
``q/k/v/o_proj``) with the norm gains trained too (``["!*norm.weight"]``). Per step the losses
agree within 1e-6 and at the end every trained tensor within 1e-5 of its largest value; the
frozen base weights are the base's, bit for bit.

The only thing taken from moezero is the adapters' initial values (its own random init, copied
into peft's modules) and the name mapping of the HF export (``hf_name``). The loop does AdamW's
decoupled weight decay on the adapters and none on the gains (``no_decay_on_norms``), clips the
global norm to 1.0 (optax's rule: no epsilon) and computes the mean next-token cross entropy.
Adam's eps is 1e-4 on both sides: Adam gives every element a step of about lr whatever its
gradient's size, so with eps 1e-8 an element whose gradient is a near-cancelling sum (its fp32
rounding, which differs between two implementations, is then a large part of it) moves in a
direction that rounding decides (4e-5 of the largest weight apart after 4 steps, measured);
eps 1e-4 keeps such steps proportional to the gradient. Measured: the losses are equal to the
last bit, the trained tensors 2.7e-6 of their largest value apart.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moezero.cli import main
from tests.support.hf import save_hf
from tests.support.world import run_world
from tests.torch_impl.test_hf_families import VOCAB, hf_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

R, ALPHA, LR, WD, CLIP, STEPS, SEQ, EPS = 4, 8.0, 2e-2, 0.1, 1.0, 4, 12, 1e-4
PROJ = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
SETS = ["moe.ep_size=1", "peft.method=lora", f"peft.r={R}", f"peft.alpha={ALPHA}",
        "peft.targets=[attn]", 'train.freeze=["!*norm.weight"]', "train.micro_batch_size=2",
        f"train.seq_len={SEQ}", "moe.aux_loss_coef=0", "moe.z_loss_coef=0",
        f"optimizer.lr={LR}", "optimizer.warmup_steps=0", "optimizer.min_lr_ratio=1",
        f"optimizer.weight_decay={WD}", f"optimizer.gradient_clipping={CLIP}",
        "optimizer.betas=[0.9, 0.95]", f"optimizer.eps={EPS}"]


def batches() -> list[torch.Tensor]:
    rng = np.random.default_rng(11)
    return [torch.from_numpy(rng.integers(0, VOCAB, (2, SEQ + 1))) for _ in range(STEPS)]


def _moezero(base: str, config: str) -> dict:
    """Rank 0 of a W=1 world: the engine's initial adapters, its losses and its params."""
    from moezero.config import load_config
    from moezero.distributed.topology import build_topology
    from moezero.engine import initialize
    from moezero.train import build_model

    cfg = load_config(config, SETS)
    topo = build_topology([1], num_experts=cfg.moe.num_experts)
    engine = initialize(build_model(cfg, topo), cfg, topology=topo, device="cpu")
    engine.load_checkpoint(base)
    params = lambda: {n: p.detach().clone().numpy()
                      for n, p in engine.model.named_parameters()}
    initial, losses = params(), []
    for batch in batches():
        loss, _ = engine.forward(batch)
        engine.backward(loss)
        engine.reduce_gradients()
        engine.optimizer_step()
        losses.append(float(loss))
    return {"initial": initial, "losses": losses, "final": params()}


def _peft_name(fqn: str, family) -> str:
    """The peft parameter of moezero's ``layers.i.attn.wX.lora_A`` (or of a norm gain)."""
    from moezero.checkpoint.hf.names import hf_name

    if fqn.endswith((".lora_A", ".lora_B")):
        base, which = fqn.rsplit(".", 1)
        hf = hf_name(base + ".weight", family).removesuffix(".weight")
        return f"base_model.model.{hf}.{which}.default.weight"
    return f"base_model.model.{hf_name(fqn, family)}"


def _plain_loop(model, named: dict) -> list[float]:
    """AdamW on the trainable params of ``model`` (a peft model) over ``batches()``."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    decay = [p for n, p in trainable.items() if not n.endswith("norm.weight")]
    gains = [p for n, p in trainable.items() if n.endswith("norm.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": gains, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=EPS)
    losses = []
    model.train()
    for batch in batches():
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        norm = sum(p.grad.double().square().sum() for p in trainable.values()).sqrt().item()
        if norm > CLIP:
            for p in trainable.values():
                p.grad.mul_(CLIP / norm)
        opt.step()
        losses.append(float(loss))
    return losses


def test_lora_with_unfrozen_norms_matches_a_plain_transformers_adamw_loop(tmp_path):
    from moezero.checkpoint.hf.arch import arch_of
    from moezero.checkpoint.hf.families import family_for
    from moezero.plan import store

    save_hf(hf_model("mixtral"), tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "base")]) == 0
    base = store.find_checkpoint(tmp_path / "base")
    family = family_for(arch_of(store.read_manifest(base)))
    ours = run_world(_moezero, 1, tmp_path, str(base), str(tmp_path / "base" / "config.yaml"))[0]

    model = peft.get_peft_model(hf_model("mixtral"), peft.LoraConfig(
        r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(PROJ.values())))
    named = dict(model.named_parameters())
    with torch.no_grad():
        for fqn, value in ours["initial"].items():
            if fqn.endswith((".lora_A", ".lora_B")):
                named[_peft_name(fqn, family)].copy_(torch.from_numpy(value))
    for name, p in named.items():
        p.requires_grad_(name.endswith("norm.weight") or ".lora_" in name)
    before = {n: p.detach().clone() for n, p in named.items()}
    losses = _plain_loop(model, named)

    np.testing.assert_allclose(ours["losses"], losses, rtol=0, atol=1e-6)
    trained, worst = 0, 0.0
    for fqn, value in ours["final"].items():
        if fqn.endswith((".lora_A", ".lora_B", "norm.weight")):
            theirs = named[_peft_name(fqn, family)].detach().numpy()
            worst = max(worst, np.abs(value - theirs).max() / np.abs(theirs).max())
            assert np.abs(value - theirs).max() <= 1e-5 * np.abs(theirs).max(), fqn
            assert not np.array_equal(theirs, before[_peft_name(fqn, family)].numpy()), fqn
            trained += 1
        else:  # frozen: the base's values (step 1's equal losses compare them with HF's)
            assert np.array_equal(value, ours["initial"][fqn]), fqn
    assert trained == 2 * 4 * 2 + 2 * 2 + 1  # 4 adapted projections x 2 layers, 5 gains
    print(f"losses {losses}: max abs difference "
          f"{np.abs(np.subtract(ours['losses'], losses)).max():.2e}; trained tensors: max "
          f"difference {worst:.2e} of their largest value")
