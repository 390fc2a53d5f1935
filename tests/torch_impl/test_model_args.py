"""One home for the model's settings: the config's ``model`` and ``moe`` sections declare them;
``ModelArgs`` (torch_impl/model/args.py) has each under the same name and default and
``model_args`` carries every one; the HF mapping's ``Arch`` has one field per architecture key
(``ARCHITECTURE``, declared in the schema)."""

from __future__ import annotations

import dataclasses

from moezero.checkpoint.hf.arch import Arch
from moezero.config import ARCHITECTURE, Config, ModelConfig, MoEConfig
from moezero.model.args import MOE_PLAN_KEYS, ModelArgs, model_args

ARGS = {f.name: f for f in dataclasses.fields(ModelArgs)}
SECTIONS = {"model": ModelConfig, "moe": MoEConfig}
OWN_DEFAULTS = {"ep_size": 1}  # a model built alone holds every expert


def config_fields() -> dict:
    return {name: field for section in SECTIONS.values()
            for name, field in section.model_fields.items()}


def test_model_args_has_every_model_and_moe_key_but_the_grouping_ones():
    fields = config_fields()
    assert len(fields) == sum(len(s.model_fields) for s in SECTIONS.values())  # no name twice
    assert set(ARGS) == set(fields) - set(MOE_PLAN_KEYS)
    assert set(MOE_PLAN_KEYS) <= set(MoEConfig.model_fields)


def test_model_args_defaults_are_the_schemas():
    for name, field in config_fields().items():
        if name in ARGS:
            want = OWN_DEFAULTS.get(name, field.default)
            assert ARGS[name].default == want, name


MLA = {"attention": "mla", "q_lora_rank": 24, "kv_lora_rank": 12, "qk_nope_head_dim": 6,
       "qk_rope_head_dim": 4, "v_head_dim": 9, "rope_interleave": False, "mla_mscale": 1.25}
"""The latent attention's fields (model/mla.py), set where its refusals allow (no QK-norm)."""


def test_model_args_carries_every_key_of_the_config():
    """Every field set to a value other than its default, so one left to the dataclass
    default would show (the MLA fields in a config of their own: ``MLA``)."""
    cfg = Config.model_validate({
        "model": {"vocab_size": 99, "dim": 48, "n_layers": 3, "n_heads": 6, "ffn_dim": 40,
                  "rope_theta": 123.0, "norm_eps": 1e-3, "init_std": 0.5, "n_kv_heads": 3,
                  "loss_chunk_tokens": 5,
                  "head_dim": 10, "qk_norm": "head", "attn_bias": "all", "first_k_dense": 1,
                  "dense_ffn_dim": 20, "partial_rotary_factor": 0.4,
                  # gpt-oss (issue 36)
                  "attn_sinks": True, "sliding_window": 7,
                  "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                  "rope_type": "yarn", "rope_factor": 4.0, "rope_original_max_positions": 64,
                  "rope_beta_fast": 16.0, "rope_beta_slow": 2.0, "rope_truncate": False,
                  "rope_attention_factor": 1.25, "rope_mscale": 0.5, "rope_mscale_all_dim": 0.25,

                  "gated_delta_layers": [0, 2], "linear_num_key_heads": 2,
                  "linear_num_value_heads": 6, "linear_key_head_dim": 12,
                  "linear_value_head_dim": 10, "linear_conv_kernel_dim": 3,
                  "gated_delta_chunk": 16, "attn_output_gate": True},
        "moe": {"num_experts": 6, "top_k": 3, "ep_size": 3, "capacity_factor": 1.5,
                "expert_group_name": "g", "aux_loss_coef": 0.5, "z_loss_coef": 0.25,
                "router_scoring": "sigmoid", "renormalize": False, "expert_bias": True,
                "bias_update_rate": 0.125, "shared_ffn_dim": 7, "shared_gate": True,
                # gpt-oss (issue 36)
                "router_bias": True, "expert_mlp_bias": True, "swiglu_limit": 7.0,
                "swiglu_alpha": 1.5,
                "n_group": 2, "topk_group": 2, "routed_scaling_factor": 2.5},
        "data": {"synthetic_vocab": 32}})
    mla = Config.model_validate({"model": {"qk_norm": "none", **MLA}})
    for name, field in ARGS.items():
        c = mla if name in MLA else cfg
        section = c.model if name in ModelConfig.model_fields else c.moe
        assert getattr(model_args(c), name) == getattr(section, name) != field.default, name


def test_architecture_keys_are_model_args_and_arch_fields():
    keys = [k for keys in ARCHITECTURE.values() for k in keys]
    assert set(keys) <= set(ARGS)
    arch = [f.name for f in dataclasses.fields(Arch)]
    assert sorted(arch) == sorted([*keys, "tie_embeddings"])
    assert "ep_size" not in keys and "init_std" not in keys  # placement and init, not the model
