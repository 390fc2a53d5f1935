"""The config's model sections, ``model`` and ``moe``: the decoder's shape, its layer kinds and
its MoE layers. Fields declared with ``_arch`` are the architecture a checkpoint holds
(``ARCHITECTURE``); ``moezero.model.args.ModelArgs`` has one field of the same name and
default for each (tests/torch_impl/test_model_args.py). Re-exported by ``moezero.config``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from moezero.config.errors import FieldError
from moezero.config.section import Section as _Section
from moezero.plan import rules

_ARCH = {"architecture": True}


def _arch(default: Any, **kwargs: Any) -> Any:
    """A ``Field`` that defines the model a checkpoint holds (listed in ``ARCHITECTURE``)."""
    return Field(default, json_schema_extra=_ARCH, **kwargs)


class ModelConfig(_Section):
    """Mixtral-style decoder: RMSNorm, RoPE attention, SwiGLU experts."""

    vocab_size: int = _arch(256, ge=2, description="Token vocabulary (256 = bytes).")
    dim: int = _arch(128, ge=1, description="Residual stream width.")
    n_layers: int = _arch(4, ge=1, description="Decoder blocks, each with one MoE layer (or a "
                                                "dense MLP: first_k_dense).")
    n_heads: int = _arch(4, ge=1, description="Attention heads; must divide dim with an even head dim.")
    ffn_dim: int = _arch(256, ge=1, description="Hidden width of each SwiGLU expert.")
    rope_theta: float = _arch(10000.0, gt=0, description="RoPE base frequency.")
    norm_eps: float = _arch(1e-5, gt=0, description="RMSNorm epsilon.")
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init.")
    # Options of the Hugging Face families (docs/model.md, docs/hf.md).
    n_kv_heads: int | None = _arch(
        None, ge=1, description="Key/value heads (grouped-query attention); must divide "
                                "n_heads; None = n_heads.")
    head_dim: int | None = _arch(
        None, ge=2, description="Dims per head (even, RoPE); None = dim / n_heads.")
    qk_norm: Literal["none", "head", "projection"] = _arch(
        "none", description="RMSNorm on q and k: per head (Qwen3-MoE) or over the whole "
                            "projection (OLMoE).")
    attn_bias: Literal["none", "qkv", "all"] = _arch(
        "none", description="Biases on the q/k/v projections (Qwen2-MoE), or on those and the "
                            "output projection.")
    first_k_dense: int = _arch(
        0, ge=0, description="Layers 0..k-1 take a dense SwiGLU MLP instead of the MoE layer "
                             "(DeepSeek-V3's first_k_dense_replace); must be < n_layers.")
    dense_ffn_dim: int | None = _arch(
        None, ge=1, description="Hidden width of the dense MLP of those layers; None = ffn_dim.")
    partial_rotary_factor: float = _arch(
        1.0, gt=0, le=1, description="Share of each head's dims RoPE rotates (GLM-4.5: 0.5, "
                                     "Qwen3-Next: 0.25); int(head dim * factor) must be even.")

    # Qwen3-Next's hybrid layers (docs/model.md, "Gated DeltaNet", "Gated attention").
    gated_delta_layers: tuple[int, ...] = _arch(
        (), description="Layers whose attention kind is gated DeltaNet (Qwen3-Next's "
                        "linear_attention layer_types); the others take softmax attention.")
    linear_num_key_heads: int = _arch(4, ge=1, description="Gated DeltaNet key heads (G).")
    linear_num_value_heads: int = _arch(4, ge=1, description="Gated DeltaNet value heads (H); "
                                                             "a multiple of the key heads.")
    linear_key_head_dim: int = _arch(32, ge=1, description="Gated DeltaNet key head dim.")
    linear_value_head_dim: int = _arch(32, ge=1, description="Gated DeltaNet value head dim.")
    linear_conv_kernel_dim: int = _arch(4, ge=1, description="Window of the causal depthwise "
                                                             "convolution before the rule.")
    gated_delta_chunk: int = Field(64, ge=1, description="Tokens per chunk of the chunked gated "
                                                         "delta rule: memory O(S·chunk).")
    attn_output_gate: bool = _arch(False, description="Softmax attention's output times "
                                                      "sigmoid(gate), the gate a second half "
                                                      "of each head's q projection (Qwen3-Next).")

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.head_dim is None and self.dim % self.n_heads:
            raise FieldError("dim", f"must be divisible by model.n_heads ({self.n_heads}), got {self.dim}")
        head = self.head_dim or self.dim // self.n_heads
        if head % 2:
            raise FieldError("head_dim" if self.head_dim else "dim",
                             f"head dim {head} must be even (RoPE)")
        rotary = int(head * self.partial_rotary_factor)
        if rotary < 2 or rotary % 2:
            raise FieldError("partial_rotary_factor", f"rotates {rotary} of the head's {head} "
                                                      f"dims: must be even and at least 2")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise FieldError("n_kv_heads", f"must divide model.n_heads ({self.n_heads}), "
                                           f"got {self.n_kv_heads}")
        return self

    @model_validator(mode="after")
    def _layer_kinds(self) -> ModelConfig:
        if self.first_k_dense >= self.n_layers:
            raise FieldError("first_k_dense", f"must be < model.n_layers ({self.n_layers}): at "
                                              f"least one MoE layer, got {self.first_k_dense}")
        bad = [i for i in self.gated_delta_layers if not 0 <= i < self.n_layers]
        if bad or len(set(self.gated_delta_layers)) != len(self.gated_delta_layers):
            raise FieldError("gated_delta_layers", f"must be distinct layers < model.n_layers "
                                                   f"({self.n_layers}), got {list(self.gated_delta_layers)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise FieldError("linear_num_value_heads", f"must be a multiple of "
                                                       f"model.linear_num_key_heads "
                                                       f"({self.linear_num_key_heads})")
        return self


class MoEConfig(_Section):
    """Mixture-of-Experts layers: routing, expert parallelism and optimizer grouping."""

    num_experts: int = _arch(8, ge=1, description="Experts per MoE layer (E).")
    top_k: int = _arch(2, ge=1, description="Experts each token is routed to.")
    ep_size: int = Field(2, ge=1, description="Expert-parallel size: ranks one layer's experts are spread over.")
    capacity_factor: float | None = _arch(
        None, gt=0, description="Expert capacity = factor * tokens * top_k / E; None = dropless.")
    expert_group_name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]+$",
        description="Name of the expert parameter group (used in optimizer-group names); "
                    "None = 'ep_size_{ep_size}'. See `group_name`.")
    max_group_size: int | None = Field(
        None, gt=0, description="Hard cap on elements per optimizer group (tiled step); None = no cap.")
    split_groups_by_expert: bool = Field(True, description="One optimizer group per (layer, expert).")
    aux_loss_coef: float = Field(0.01, ge=0, description="Weight of the load-balancing aux loss.")
    z_loss_coef: float = Field(0.001, ge=0, description="Weight of the router z-loss.")
    # Router variants and shared experts (docs/model.md, "Router variants"; "Shared expert").
    router_scoring: Literal["softmax", "sigmoid"] = _arch(
        "softmax", description="Router scores: softmax over experts, or a sigmoid per expert.")
    renormalize: bool = _arch(True, description="Renormalise the top-k gates to sum 1 (Mixtral); "
                                                "false: the raw scores (OLMoE, Qwen2-MoE).")
    expert_bias: bool = _arch(False, description="Aux-loss-free balancing (DeepSeek-V3): a "
                                                 "per-expert bias on the scores for the top-k "
                                                 "choice, updated outside the optimizer.")
    bias_update_rate: float = Field(1e-3, ge=0, description="Expert bias step per optimizer "
                                                            "step: bias += rate * sign(mean "
                                                            "load - load).")
    shared_ffn_dim: int = _arch(0, ge=0, description="Hidden width of the always-on shared "
                                                     "SwiGLU expert; 0 = none.")
    shared_gate: bool = _arch(False, description="Scale the shared expert by sigmoid(x . g) "
                                                 "per token (Qwen2-MoE).")

    @property
    def group_name(self) -> str:
        """The resolved expert group name: ``expert_group_name`` or ``ep_size_{ep_size}``."""
        return rules.expert_group_name(self.expert_group_name, ep_size=self.ep_size)

    @model_validator(mode="after")
    def _routing(self) -> MoEConfig:
        if self.top_k > self.num_experts:
            raise FieldError("top_k", f"must be <= moe.num_experts ({self.num_experts}), got {self.top_k}")
        problem = rules.ep_size_problem(self.ep_size, num_experts=self.num_experts)
        if problem is not None:
            raise FieldError("ep_size", problem)
        if self.shared_gate and not self.shared_ffn_dim:
            raise FieldError("shared_gate", "needs a shared expert (moe.shared_ffn_dim > 0)")
        return self


ARCHITECTURE: dict[str, tuple[str, ...]] = {
    name: tuple(k for k, f in section.model_fields.items() if f.json_schema_extra == _ARCH)
    for name, section in (("model", ModelConfig), ("moe", MoEConfig))}
"""The keys declared with ``_arch``: what a resume adopts when unset and refuses to change
unless ``checkpoint.allow_arch_change`` lists it (``moezero.checkpoint.adopt``)."""
ARCHITECTURE_KEYS = tuple(f"{section}.{key}" for section, keys in ARCHITECTURE.items()
                          for key in keys)
