"""The decoder's settings, ``ModelArgs``, and the one mapping from the run config to them.

The config's ``model`` and ``moe`` sections (``moezero.config.model``) declare every setting
once; ``ModelArgs`` has a field of the same name and default for each (all but
``MOE_PLAN_KEYS``, which configure the optimizer's grouping, not the model) and
``model_args`` fills them by name, so a field missing from either side fails at once
(tests/torch_impl/test_model_args.py checks both directions and the defaults). The JAX
counterpart is ``reference/model.py: ModelConfig`` (parity_tests/test_model.py checks its
fields).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from moezero.model.rope import Yarn
from moezero.model.router import RouterOptions

if TYPE_CHECKING:  # the model imports no pydantic (benchmarks' peer venvs build it bare)
    from moezero.config import Config

MOE_PLAN_KEYS = ("max_group_size", "split_groups_by_expert", "split_dense_by_layer")
"""``moe.*`` keys of the optimizer's grouping (``moezero.zero.groups``), not of the model."""


@dataclass(frozen=True)
class ModelArgs:
    """Shape and MoE settings of the decoder: the fields of ``Config.model`` and
    ``Config.moe`` of the same names (``model_args``), every one but ``MOE_PLAN_KEYS``, with
    the same defaults except ``ep_size`` (1: a model built alone holds every expert)."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    loss_chunk_tokens: int | None = None
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = None
    ep_size: int = 1
    expert_group_name: str | None = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    n_kv_heads: int | None = None  # None: n_heads (multi-head attention)
    head_dim: int | None = None  # None: dim // n_heads
    qk_norm: str = "none"  # attention.QK_NORMS
    attn_bias: str = "none"  # attention.ATTN_BIASES
    router_scoring: str = "softmax"  # router.SCORINGS
    renormalize: bool = True
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    shared_ffn_dim: int = 0  # 0: no shared expert
    shared_gate: bool = False
    first_k_dense: int = 0  # layers 0..k-1: the dense MLP kind (model/dense.py)
    dense_ffn_dim: int | None = None  # None: ffn_dim
    partial_rotary_factor: float = 1.0  # the share of each head's dims RoPE rotates
    # gpt-oss (issue 36): sinks, sliding windows, YaRN (model/rope.py), router and expert
    # biases, clamped SwiGLU (model/experts.py).
    attn_sinks: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | tuple[str, ...] | None = None  # None: all sliding if a window, else full
    rope_type: str = "default"  # rope.ROPE_TYPES
    rope_factor: float = 1.0
    rope_original_max_positions: int | None = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float | None = None
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    router_bias: bool = False
    expert_mlp_bias: bool = False
    swiglu_limit: float | None = None  # None: plain SwiGLU
    swiglu_alpha: float = 1.702
    # Multi-head latent attention (model/mla.py)
    attention: str = "gqa"  # kinds.ATTENTION_KINDS: gqa | mla
    q_lora_rank: int | None = None  # None: a plain q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    mla_mscale: float = 1.0  # softmax scale = mla_mscale² / sqrt(nope + rope dims)
    n_group: int = 1  # DeepSeek-V3's group-limited routing: expert groups (1: none)
    topk_group: int = 1  # groups a token's experts are chosen from
    routed_scaling_factor: float = 1.0  # factor on the routed gates
    # Qwen3-Next's hybrid layers (model/gated_delta.py; the attention's output gate).
    gated_delta_layers: tuple[int, ...] = ()  # layers whose attention kind is gated DeltaNet
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    gated_delta_chunk: int = 64  # tokens per chunk of the chunked rule (numerics, not arch)
    attn_output_gate: bool = False  # sigmoid output gate per head dim (q_proj holds it)

    @property
    def kv_heads(self) -> int:
        """Key/value heads G (``n_kv_heads``, default H)."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """Head dim K (``head_dim``, default D/H)."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates: ``int(head_size * partial_rotary_factor)``, as
        transformers computes it."""
        return int(self.head_size * self.partial_rotary_factor)

    @property
    def dense_hidden(self) -> int:
        """Hidden width of the dense MLP layers (``dense_ffn_dim``, default ``ffn_dim``)."""
        return self.dense_ffn_dim or self.ffn_dim

    @property
    def router(self) -> RouterOptions:
        return RouterOptions(self.router_scoring, self.renormalize, self.expert_bias,
                             self.bias_update_rate, linear_bias=self.router_bias,
                             n_group=self.n_group, topk_group=self.topk_group,
                             routed_scaling_factor=self.routed_scaling_factor)

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (``layer_types``, ``sliding_window``), or None."""
        kind = self.layer_types[layer] if self.layer_types else "sliding_attention"
        return self.sliding_window if kind == "sliding_attention" else None

    @property
    def yarn(self) -> Yarn | None:
        """The YaRN scaling of the RoPE (``rope_type: yarn``), or None."""
        if self.rope_type != "yarn":
            return None
        return Yarn(self.rope_factor, self.rope_original_max_positions, self.rope_beta_fast,
                    self.rope_beta_slow, self.rope_truncate, self.rope_attention_factor,
                    self.rope_mscale, self.rope_mscale_all_dim)


def model_args(cfg: Config) -> ModelArgs:
    """The ``ModelArgs`` of a run: each field from the ``model`` or ``moe`` key of its name."""
    values = {**cfg.model.model_dump(), **cfg.moe.model_dump()}
    return ModelArgs(**{f.name: values[f.name] for f in fields(ModelArgs)})
