"""The reference model's settings, ``ModelConfig``: the ``model.*`` / ``moe.*`` config keys
(torch: ``moezero.model.args.ModelArgs``, same names; parity_tests/test_model.py checks the
fields), with the derived sizes and each layer's kinds. Re-exported by ``reference.model``.
"""

from __future__ import annotations

import dataclasses

from moezero.plan import rules


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model hyperparameters (``model.*`` / ``moe.*`` config keys). Hashable: jit-static."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 128
    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float | None = None  # None = dropless
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    # The options of the Hugging Face families (docs/model.md; torch: ModelArgs, same names).
    n_kv_heads: int | None = None  # G; None = n_heads
    head_dim: int | None = None  # K; None = dim / n_heads
    qk_norm: str = "none"  # "none" | "head" (per head, Qwen3-MoE) | "projection" (OLMoE)
    attn_bias: str = "none"  # "none" | "qkv" (Qwen2-MoE) | "all"
    router_scoring: str = "softmax"  # "softmax" | "sigmoid"
    renormalize: bool = True  # top-k gates renormalised to sum 1
    expert_bias: bool = False  # aux-loss-free balancing bias (a buffer: never optimized)
    bias_update_rate: float = 1e-3
    shared_ffn_dim: int = 0  # 0: no shared expert
    shared_gate: bool = False
    first_k_dense: int = 0  # layers 0..k-1: the dense MLP kind (reference/dense.py)
    dense_ffn_dim: int | None = None  # None: ffn_dim
    partial_rotary_factor: float = 1.0  # RoPE rotates the first int(K * factor) dims of a head
    # gpt-oss (issue 36): sinks, sliding windows, YaRN (reference/rope.py), router and expert
    # biases, the clamped SwiGLU (reference/moe.py)
    attn_sinks: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # None: all sliding if sliding_window, else full
    rope_type: str = "default"  # "default" | "yarn"
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
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    attention: str = "gqa"  # "gqa" | "mla": latent attention (reference/mla.py), the fields below
    q_lora_rank: int | None = None  # None: a plain q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    mla_mscale: float = 1.0  # softmax scale = mla_mscale² / sqrt(nope + rope dims)
    n_group: int = 1  # DeepSeek-V3's group-limited routing (reference/moe.py: limit_to_groups)
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # factor on the routed gates
    gated_delta_layers: tuple[int, ...] = ()  # Qwen3-Next's (reference/gated_delta.py)
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    gated_delta_chunk: int = 64  # torch's chunk length (the reference runs the recurrence)
    attn_output_gate: bool = False  # wq: per head its query rows, then its gate rows
    # LoRA (torch: the ``peft`` section, ``moezero.model.lora``): rank (0: none), alpha / r,
    # and the targets (attn, shared, experts, mlp, or one projection of them, e.g. attn.wq)
    lora_r: int = 0
    lora_scale: float = 1.0
    lora_targets: tuple[str, ...] = ()

    def wants_lora(self, owner: str, proj: str) -> bool:
        """Whether projection ``proj`` of ``owner`` (attn, shared, experts, mlp) has adapters."""
        return bool(self.lora_r) and (owner in self.lora_targets
                                      or f"{owner}.{proj}" in self.lora_targets)

    def __post_init__(self):
        if self.head_dim is None and self.dim % self.n_heads or self.head_size % 2:
            raise ValueError(f"dim={self.dim} must split into n_heads={self.n_heads} even heads")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} rotates "
                             f"{self.rotary_dim} dims: must be even and >= 2")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0 or None")
        if self.shared_gate and not self.shared_ffn_dim:
            raise ValueError("shared_gate needs a shared expert (shared_ffn_dim > 0)")
        if not 0 <= self.first_k_dense < self.n_layers:
            raise ValueError(f"first_k_dense={self.first_k_dense} must be in [0, n_layers)")
        problem = rules.group_problem(num_experts=self.num_experts, top_k=self.top_k,
                                      n_group=self.n_group, topk_group=self.topk_group)
        if problem is not None:
            raise ValueError(f"{problem[0]}: {problem[1]}")

    def mlp_kind(self, layer: int) -> str:
        """Layer ``layer``'s MLP kind: ``dense`` below ``first_k_dense``, else ``moe`` (torch:
        ``moezero.model.kinds.layer_kinds``)."""
        return "dense" if layer < self.first_k_dense else "moe"

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None (torch: ``ModelArgs.window``)."""
        kind = self.layer_types[layer] if self.layer_types else "sliding_attention"
        return self.sliding_window if kind == "sliding_attention" else None

    @property
    def dense_hidden(self) -> int:
        """The dense MLP's hidden width: ``dense_ffn_dim``, default ``ffn_dim``."""
        return self.dense_ffn_dim or self.ffn_dim

    @property
    def head_size(self) -> int:
        """K: ``head_dim``, default D/H."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """G: ``n_kv_heads``, default H."""
        return self.n_kv_heads or self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates: ``int(K * partial_rotary_factor)``."""
        return int(self.head_size * self.partial_rotary_factor)
