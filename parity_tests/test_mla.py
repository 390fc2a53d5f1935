"""Op parity of multi-head latent attention (``model/mla.py`` vs ``reference/mla.py``): the
kind alone, forward and the gradients of its input and weights, fp32 and bf16, on the two MLA
configs of ``models.OPTIONS`` (a query latent with interleaved RoPE dims, biases and YaRN's
softmax factor; a plain q_proj with half-split RoPE dims), causal and with a document mask.
The whole decoder with MLA is in test_model.py (``OPTIONS``); here also the decoder with LoRA
adapters on every MLA projection (non-zero ``lora_B``), forward and backward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from moezero.model.packing import document_mask
from moezero.reference.mla import mla_attention
from moezero.reference.packing import document_layout
from parity_tests.models import OPTIONS, jax_run, perturb, to_jax, tokens, torch_model, torch_run
from parity_tests.tolerances import FP32, KIND_REL, TOLERANCES
from tests.support.compare import (
    assert_close_by_fqn,
    assert_max_abs,
    assert_max_rel,
    assert_rel,
    jax_fqns,
    torch_fqns,
)

DTYPES = {"fp32": (torch.float32, jnp.float32), "bf16": (torch.bfloat16, jnp.bfloat16)}
CONFIGS = [k for k in OPTIONS if k.startswith("mla-")]
jit_mla = jax.jit(mla_attention, static_argnames="cfg")
DOCS = np.array([[0] * 5 + [1] * 6, [2] * 11])  # S = 11


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", CONFIGS)
def test_mla(name, dtype, docs):
    cfg = OPTIONS[name]
    model = perturb(torch_model(cfg, seed=5), seed=5)
    params = jax.tree.map(lambda a: a.astype(DTYPES[dtype][1]),
                          to_jax(model, cfg)["layers"][1]["attn"])
    attn = model.layers[1].attn.to(DTYPES[dtype][0])
    x = np.random.default_rng(6).standard_normal((2, 11, cfg.dim)).astype(np.float32)
    x_t = torch.from_numpy(x).to(DTYPES[dtype][0]).requires_grad_(True)
    x_j = jnp.asarray(x_t.detach().float().numpy(), DTYPES[dtype][1])
    mask_t = document_mask(torch.from_numpy(DOCS)) if docs else None
    mask_j = document_layout(jnp.asarray(DOCS)) if docs else None
    out = attn(x_t, mask_t)
    tol = TOLERANCES[dtype]
    assert_max_rel(out, jit_mla(params, x_j, cfg, mask_j), KIND_REL[dtype], f"{name} {dtype}")
    out.float().square().sum().backward()

    def loss(p, x):
        return jnp.sum(jnp.square(mla_attention(p, x, cfg, mask_j).astype(jnp.float32)))
    g_p, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x_j)
    assert_max_rel(x_t.grad, g_x, KIND_REL[dtype], f"{name} {dtype} input grad")
    assert_close_by_fqn(torch_fqns(attn, grads=True), jax_fqns(g_p), tol.grad_rel,
                        f"{name} {dtype} weight grads")


@pytest.mark.parametrize("name", CONFIGS)
def test_lora_on_every_mla_projection(name):
    cfg = dataclasses.replace(OPTIONS[name], lora_r=3, lora_scale=2.0, lora_targets=("attn",))
    model = torch_model(cfg, seed=7)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            if fqn.endswith(".lora_B"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    adapted = {f.split(".")[3] for f, _ in model.named_parameters() if f.endswith(".lora_A")}
    q = {"q_a_proj", "q_b_proj"} if cfg.q_lora_rank else {"q_proj"}
    assert adapted == q | {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    batch = tokens(8)
    mine, ref = torch_run(model, batch), jax_run(to_jax(model, cfg), batch, cfg)
    assert_rel(mine.loss, ref.loss, FP32.loss_rel, f"{name} lora loss")
    assert_max_abs(mine.logits, ref.logits, FP32.logits_abs, f"{name} lora logits")
    assert_close_by_fqn(mine.grads, ref.grads, FP32.grad_rel, f"{name} lora grads")
