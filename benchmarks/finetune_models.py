"""The model families of the ``finetune`` series (issues 26, 36, 37): for each, the random
Hugging Face model both sides load (written once by ``save``, ``moezero import-hf``-ed for
moezero, ``from_pretrained`` for the peer) and the LoRA targets of each side.

Every family shares the Qwen3-MoE row's sizes (``benchmarks.finetune``: dim 256, 4 layers,
4 heads / 2 KV, 8 experts of width 256, top-2); what differs is the architecture each family
brings:

- ``gpt_oss``: attention sinks, sliding windows of 64 tokens (shorter than most
  conversations) alternating with full attention, q/k/v/o biases, a router bias, biased
  experts with the clamped SwiGLU, YaRN RoPE (gpt-oss's defaults);
- ``deepseek_v3``: multi-head latent attention with ``q_lora_rank``, sigmoid routing with a
  correction bias over ``n_group`` 4 groups of which ``topk_group`` 2 are kept, one dense
  SwiGLU layer first (``first_k_dense_replace``), one shared expert, routed scaling 2.5;
- ``qwen3_next``: three gated DeltaNet layers then one gated full-attention layer (partial
  rotary), the sigmoid-gated shared expert beside the routed ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass(frozen=True)
class Family:
    """One row family: its label, the moezero LoRA targets and extra ``--set`` items, and the
    peer's PEFT ``target_modules`` / ``target_parameters`` (the same projections)."""

    label: str
    hf_class: str
    targets: tuple[str, ...]
    peer_modules: tuple[str, ...]
    peer_parameters: tuple[str, ...] = FUSED_EXPERTS
    aux_loss: bool = True
    peer_packs: bool = True
    moezero_extra: tuple[str, ...] = ()
    shape: str = ""


FAMILIES = {
    "qwen3_moe": Family("Qwen3-MoE", "Qwen3MoeForCausalLM", ("attn", "experts"), ATTN,
                        shape="GQA softmax attention with QK-norm"),
    "gpt_oss": Family("gpt-oss", "GptOssForCausalLM", ("attn", "experts"), ATTN,
                      shape="attention sinks, sliding window 64 on layers 0 and 2 (full on 1 "
                            "and 3), q/k/v/o biases, YaRN; router bias, top-k then softmax, "
                            "biased experts with the clamped SwiGLU (limit 7)"),
    "deepseek_v3": Family("DeepSeek-V3", "DeepseekV3ForCausalLM", ("attn", "experts"),
                          ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                           "o_proj"),
                          aux_loss=False, moezero_extra=("moe.bias_update_rate=0",),
                          shape="MLA (4 heads, q_lora_rank 96, kv_lora_rank 64, nope 32 + rope 16, "
                                "v 32), first layer dense SwiGLU (width 512), sigmoid routing "
                                "with the correction bias, n_group 4 / topk_group 2, one "
                                "shared expert, routed scaling 2.5"),
    "qwen3_next": Family("Qwen3-Next", "Qwen3NextForCausalLM",
                         ("attn", "linear_attn", "experts"),
                         (*ATTN, "in_proj_qkvz", "in_proj_ba", "out_proj"),
                         peer_packs=False,
                         shape="gated DeltaNet on layers 0-2 (2 key / 4 value heads of 64, "
                               "conv 4), gated full attention on layer 3 (partial rotary "
                               "0.25), sigmoid-gated shared expert (width 256)"),
}
"""Family key (the HF ``model_type``) -> its row parameters. ``deepseek_v3``: transformers
adds no router loss and keeps the correction bias fixed, so moezero runs with neither
(``aux_loss_coef`` 0, ``bias_update_rate`` 0). ``qwen3_next``: transformers refuses packed
rows for its gated DeltaNet without the CUDA-only ``causal_conv1d`` and ``fla`` kernels
("can't keep packed sequences apart"), so the peer trains one conversation per row, padded
(``peer_packs``)."""


def hf_config(family: str, model: dict, vocab: int):
    """The transformers config of ``family`` at the series' sizes (``model``); Qwen3-MoE's
    is ``moezero.examples.tiny_hf``'s."""
    import transformers

    dim, ffn, heads = model["dim"], model["ffn_dim"], model["n_heads"]
    common = dict(vocab_size=vocab, hidden_size=dim, num_hidden_layers=model["n_layers"],
                  num_attention_heads=heads, num_key_value_heads=model["n_kv_heads"],
                  num_experts_per_tok=model["top_k"], tie_word_embeddings=False,
                  max_position_embeddings=4096, eos_token_id=2, pad_token_id=0,
                  bos_token_id=None)
    aux = dict(output_router_logits=True, router_aux_loss_coef=model["aux_loss_coef"])
    if family == "gpt_oss":
        return transformers.GptOssConfig(
            **common, **aux, intermediate_size=ffn, head_dim=dim // heads,
            num_local_experts=model["num_experts"], sliding_window=64)
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": heads}, intermediate_size=2 * ffn, moe_intermediate_size=ffn,
            n_routed_experts=model["num_experts"], n_group=4, topk_group=2,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, num_nextn_predict_layers=0)
    if family == "qwen3_next":
        layers = ["linear_attention"] * (model["n_layers"] - 1) + ["full_attention"]
        return transformers.Qwen3NextConfig(
            **common, **aux, intermediate_size=ffn, moe_intermediate_size=ffn,
            shared_expert_intermediate_size=ffn, head_dim=dim // heads,
            num_experts=model["num_experts"], norm_topk_prob=True, layer_types=layers,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_conv_kernel_dim=4, partial_rotary_factor=0.25)
    raise ValueError(f"finetune series: no model family {family!r}")


def save(folder: Path, family: str, model: dict, vocab: int, seed: int) -> int:
    """A random ``family`` model (transformers' own init, fp32 safetensors) in ``folder``
    beside the tokenizer; its parameter count."""
    import torch
    import transformers

    from moezero.examples import tiny_hf

    if family == "qwen3_moe":
        return tiny_hf.save_model(folder, model, vocab, seed)
    cfg = hf_config(family, model, vocab)
    torch.manual_seed(seed)
    hf = getattr(transformers, FAMILIES[family].hf_class)(cfg).float()
    hf.save_pretrained(folder)
    return sum(p.numel() for p in hf.parameters())
