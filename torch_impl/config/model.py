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
    loss_chunk_tokens: int | None = Field(
        None, ge=1, description="Compute the LM head's cross-entropy this many tokens at a "
                                "time (logits made again in backward), so the tokens x vocab "
                                "logits never exist whole; None = all at once.")
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
    # gpt-oss (issue 36): attention sinks, sliding windows per layer, YaRN RoPE (model/rope.py).
    attn_sinks: bool = _arch(False, description="A learned logit per head that joins every "
                                                "softmax and is then dropped (gpt-oss).")
    sliding_window: int | None = _arch(
        None, ge=1, description="Keys a sliding-window layer reads: query i sees keys j with "
                                "i - window < j <= i; None = no window.")
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = _arch(
        None, description="Attention per layer (n_layers entries, transformers' names); None: "
                          "every layer sliding when sliding_window is set, else full.")
    rope_type: Literal["default", "yarn"] = _arch(
        "default", description="RoPE frequencies: plain, or YaRN (transformers' yarn).")
    rope_factor: float = _arch(1.0, gt=0, description="YaRN's context scaling factor.")
    rope_original_max_positions: int | None = _arch(
        None, ge=1, description="YaRN: the pretraining context (original_max_position_embeddings).")
    rope_beta_fast: float = _arch(32.0, gt=0, description="YaRN: extrapolation boundary (rotations).")
    rope_beta_slow: float = _arch(1.0, gt=0, description="YaRN: interpolation boundary (rotations).")
    rope_truncate: bool = _arch(True, description="YaRN: round the correction range to integers.")
    rope_attention_factor: float | None = _arch(
        None, gt=0, description="YaRN: cos/sin scale; None = from factor (and the mscales).")
    rope_mscale: float | None = _arch(None, description="YaRN (DeepSeek-V3): mscale of the "
                                                        "attention factor's numerator.")
    rope_mscale_all_dim: float | None = _arch(
        None, description="YaRN (DeepSeek-V3): mscale_all_dim of its denominator.")

    @model_validator(mode="after")
    def _windows_and_rope(self) -> ModelConfig:
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise FieldError("layer_types", f"needs one entry per layer ({self.n_layers}), got "
                                            f"{len(self.layer_types)}")
        if "sliding_attention" in (self.layer_types or ()) and self.sliding_window is None:
            raise FieldError("layer_types", "sliding_attention needs model.sliding_window")
        if self.rope_type == "yarn" and self.rope_original_max_positions is None:
            raise FieldError("rope_original_max_positions", "rope_type yarn needs it")
        return self
    # Multi-head latent attention (docs/model.md, "Multi-head latent attention"; model/mla.py).
    attention: Literal["gqa", "mla"] = _arch(
        "gqa", description="Attention kind of every layer: grouped-query softmax attention, or "
                           "DeepSeek-V3's multi-head latent attention (the fields below).")
    q_lora_rank: int | None = _arch(
        None, ge=1, description="MLA: rank of the query latent (q_a_proj, q_a_layernorm, "
                                "q_b_proj); None = one plain q_proj.")
    kv_lora_rank: int = _arch(512, ge=1, description="MLA: rank of the key/value latent.")
    qk_nope_head_dim: int = _arch(128, ge=1, description="MLA: per-head query/key dims "
                                                         "without RoPE.")
    qk_rope_head_dim: int = _arch(64, ge=2, description="MLA: per-head query/key dims with "
                                                        "RoPE (the key's shared by all heads); "
                                                        "even.")
    v_head_dim: int = _arch(128, ge=1, description="MLA: per-head value dims.")
    rope_interleave: bool = _arch(True, description="MLA: the RoPE dims are stored as "
                                                    "interleaved pairs (DeepSeek-V3).")
    mla_mscale: float = _arch(1.0, gt=0, description="MLA: the softmax scale is "
                                                     "mla_mscale² / sqrt(qk_nope_head_dim + "
                                                     "qk_rope_head_dim) (YaRN's mscale_all_dim "
                                                     "factor; 1 without it).")

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
    def _latent_attention(self) -> ModelConfig:
        if self.attention != "mla":
            return self
        if self.qk_rope_head_dim % 2:
            raise FieldError("qk_rope_head_dim", f"must be even (RoPE), got {self.qk_rope_head_dim}")
        if self.qk_norm != "none":
            raise FieldError("qk_norm", "must be none with model.attention: mla (its latents "
                                        "have their own norms)")
        if self.attn_bias == "qkv":
            raise FieldError("attn_bias", "must be none or all with model.attention: mla "
                                          "(transformers' attention_bias)")
        # MLA's heads are sized by its own fields; transformers' head_dim is the rotary width
        for key, same in (("n_kv_heads", self.n_heads), ("head_dim", self.qk_rope_head_dim)):
            if getattr(self, key) not in (None, same):
                raise FieldError(key, f"must be null or {same} with model.attention: mla (its "
                                      "heads are sized by qk_nope_head_dim, qk_rope_head_dim, "
                                      f"v_head_dim), got {getattr(self, key)}")
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
    split_dense_by_layer: bool = Field(
        False, description="One dense optimizer group per block (layers.N, embed, lm_head, "
                           "norm) and user group, so a ZeRO-3 gather unit gathers its own block "
                           "only (big models at stage 3); else one per user group.")
    aux_loss_coef: float = Field(0.01, ge=0, description="Weight of the load-balancing aux loss.")
    z_loss_coef: float = Field(0.001, ge=0, description="Weight of the router z-loss.")
    # Router variants and shared experts (docs/model.md, "Router variants"; "Shared expert").
    router_scoring: Literal["softmax", "sigmoid", "topk_softmax"] = _arch(
        "softmax", description="Router scores: softmax over experts, a sigmoid per expert, or "
                               "the top-k logits first, then a softmax over those k (gpt-oss).")
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
    # gpt-oss (issue 36): router bias, expert biases, clamped SwiGLU (model/experts.py).
    router_bias: bool = _arch(False, description="A bias on the router's logits (gpt-oss).")
    expert_mlp_bias: bool = _arch(False, description="Biases on every expert's gate, up and "
                                                     "down projections (gpt-oss).")
    swiglu_limit: float | None = _arch(
        None, gt=0, description="gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit, "
                                "(up + 1) * gate * sigmoid(alpha * gate); None = plain SwiGLU.")
    swiglu_alpha: float = _arch(1.702, gt=0, description="The sigmoid gain of the clamped "
                                                         "SwiGLU (used with swiglu_limit).")
    # DeepSeek-V3 / GLM-4.5 routing (docs/model.md, "MoE layer").
    n_group: int = _arch(1, ge=1, description="Expert groups (DeepSeek-V3's n_group): the top-k "
                                              "choice is limited to the topk_group groups whose "
                                              "two best experts score highest; 1 = no groups.")
    topk_group: int = _arch(1, ge=1, description="Groups a token's experts are chosen from "
                                                 "(<= n_group).")
    routed_scaling_factor: float = _arch(1.0, gt=0, description="Factor on the routed experts' "
                                                                "gates (after renormalising).")

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
        problem = rules.group_problem(num_experts=self.num_experts, top_k=self.top_k,
                                      n_group=self.n_group, topk_group=self.topk_group)
        if problem is not None:
            raise FieldError(*problem)
        return self


ARCHITECTURE: dict[str, tuple[str, ...]] = {
    name: tuple(k for k, f in section.model_fields.items() if f.json_schema_extra == _ARCH)
    for name, section in (("model", ModelConfig), ("moe", MoEConfig))}
"""The keys declared with ``_arch``: what a resume adopts when unset and refuses to change
unless ``checkpoint.allow_arch_change`` lists it (``moezero.checkpoint.adopt``)."""
ARCHITECTURE_KEYS = tuple(f"{section}.{key}" for section, keys in ARCHITECTURE.items()
                          for key in keys)
