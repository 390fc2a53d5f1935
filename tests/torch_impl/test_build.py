"""The model builder (``moezero.model.build``): meta and materialised models agree on FQNs,
shapes, flags and expert tags; a materialised model is bit for bit what the construction it
replaced gave (``Decoder`` + ``apply_lora`` + ``init_weights``); adapters exist iff LoRA is on;
``ep_rank`` picks the experts held. The only test besides the builder that constructs
``Decoder`` directly: it is the oracle."""

from __future__ import annotations

import pytest
import torch

from moezero.config import load_config
from moezero.model.args import ModelArgs, model_args
from moezero.model.build import build_decoder, config_decoder, config_init
from moezero.model.decoder import Decoder, init_weights
from moezero.model.lora import LoraOptions, apply_lora, lora_options
from moezero.model.materialize import KeyedInit

ARGS = ModelArgs(vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24,
                 num_experts=4, top_k=2, ep_size=2, shared_ffn_dim=8)
LORA = LoraOptions(r=2, alpha=4.0, targets=("attn", "shared", "experts"))
SMALL = ["model.dim=16", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=24",
         "moe.num_experts=4", "moe.ep_size=2", "train.seed=7", "model.init_std=0.05"]


def _described(model: torch.nn.Module) -> dict:
    return {fqn: (tuple(p.shape), p.dtype, p.requires_grad, getattr(p, "moe", None))
            for fqn, p in model.named_parameters()}


@pytest.mark.parametrize("lora", [None, LORA])
@pytest.mark.parametrize("ep_rank", [0, 1])
def test_meta_and_materialised_have_the_same_params(lora, ep_rank):
    meta = build_decoder(ARGS, where="meta", lora=lora, ep_rank=ep_rank)
    real = build_decoder(ARGS, where="cpu", lora=lora, ep_rank=ep_rank)
    assert all(p.is_meta for p in meta.parameters())
    assert not any(p.is_meta for p in real.parameters())
    assert _described(meta) == _described(real)


@pytest.mark.parametrize("lora", [None, LORA])
def test_materialised_is_the_old_construction_bit_for_bit(lora):
    """``Decoder`` + ``apply_lora`` + ``init_weights``, as train.py, the parity models and the
    benchmarks wrote it before the builder."""
    old = Decoder(ARGS, ep_rank=1)
    apply_lora(old, lora)
    init_weights(old, 3, 0.05)
    new = build_decoder(ARGS, where="cpu", lora=lora, init=KeyedInit(3, 0.05), ep_rank=1)
    assert new.state_dict().keys() == old.state_dict().keys()
    assert all(torch.equal(v, old.state_dict()[k]) for k, v in new.state_dict().items())


def test_config_decoder_is_the_runs_model():
    """``config_decoder(cfg, where='cpu')``: ``model_args``, the ``peft`` adapters and the
    run's keyed init (``train.seed``, ``model.init_std``)."""
    cfg = load_config(None, [*SMALL, "peft.method=lora", "peft.targets=[attn, experts]"])
    old = apply_lora(Decoder(model_args(cfg), ep_rank=1), lora_options(cfg.peft))
    init_weights(old, cfg.train.seed, cfg.model.init_std)
    new = config_decoder(cfg, where="cpu", ep_rank=1)
    assert all(torch.equal(v, old.state_dict()[k]) for k, v in new.state_dict().items())
    assert new.state_dict().keys() == old.state_dict().keys()
    assert (config_init(cfg).seed, config_init(cfg).std) == (7, 0.05)


def test_torch_init_when_no_init_is_given():
    """``init=None`` on a device: the modules' own initialisers, from the global generator."""
    torch.manual_seed(0)
    old = Decoder(ARGS)
    torch.manual_seed(0)
    new = build_decoder(ARGS, where="cpu")
    assert all(torch.equal(v, old.state_dict()[k]) for k, v in new.state_dict().items())


@pytest.mark.parametrize("method", ["none", "lora"])
def test_adapters_iff_lora_is_on(method):
    cfg = load_config(None, [*SMALL, f"peft.method={method}"])
    assert cfg.peft.uses_lora == (method == "lora")
    adapters = [f for f, _ in config_decoder(cfg).named_parameters() if ".lora_" in f]
    assert bool(adapters) == cfg.peft.uses_lora
    assert not any(".lora_" in f for f, _ in config_decoder(cfg, adapters=False).named_parameters())


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_ep_rank_selects_the_experts(ep_rank):
    model = build_decoder(ARGS, where="meta", lora=LORA, ep_rank=ep_rank)
    experts = {int(f.split(".experts.")[1].split(".")[0])
               for f, _ in model.named_parameters() if ".moe.experts." in f}
    assert experts == {2 * ep_rank, 2 * ep_rank + 1}
    tags = {p.moe.expert for f, p in model.named_parameters() if ".moe.experts." in f}
    assert tags == experts


@pytest.mark.parametrize("where", ["meta", torch.device("meta")])
def test_a_meta_model_takes_no_init(where):
    with pytest.raises(ValueError, match="meta model holds no values"):
        build_decoder(ARGS, where=where, init=KeyedInit(0))


def test_config_decoder_on_a_meta_device_object():
    cfg = load_config(None, SMALL)
    model = config_decoder(cfg, where=torch.device("meta"))
    assert all(p.is_meta for p in model.parameters())
