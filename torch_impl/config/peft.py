"""The ``peft`` section: LoRA adapters beside frozen base weights (docs/finetune.md); the model
side is ``moezero.model.lora``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from moezero.config.section import Section

ATTN_PROJECTIONS = {"gqa": ("wq", "wk", "wv", "wo"),
                    "mla": ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                            "o_proj")}
"""The adaptable projections of each attention kind (``model.attention``)."""

LORA_TARGETS = ("attn", "attn.wq", "attn.wk", "attn.wv", "attn.wo", "shared", "shared.w1",
                "shared.w2", "shared.w3", "experts", "experts.w1", "experts.w2", "experts.w3",
                "mlp", "mlp.w1", "mlp.w2", "mlp.w3",
                *(f"attn.{p}" for p in ATTN_PROJECTIONS["mla"]),
                "linear_attn", "linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba",
                "linear_attn.out_proj")


def attention_target_problem(targets, attention: str, q_lora_rank: int | None) -> str | None:
    """Why ``peft.targets`` cannot adapt the model's attention (a projection it has not), or
    None: MLA has ``q_proj`` without ``q_lora_rank`` and ``q_a_proj``/``q_b_proj`` with it."""
    have = set(ATTN_PROJECTIONS[attention])
    if attention == "mla":
        have -= {"q_a_proj", "q_b_proj"} if q_lora_rank is None else {"q_proj"}
    for target in targets:
        owner, _, proj = target.partition(".")
        if owner == "attn" and proj and proj not in have:
            return (f"names {target}, but model.attention {attention} (q_lora_rank "
                    f"{q_lora_rank}) has attn.{', attn.'.join(sorted(have))}")
    return None


class PeftConfig(Section):
    """Parameter-efficient fine-tuning: LoRA adapters beside frozen base weights
    (docs/finetune.md)."""

    method: Literal["none", "lora"] = Field(
        "none", description="'lora': train low-rank adapters only; every other parameter is "
                            "frozen (train.freeze may unfreeze more with '!' patterns).")
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0, description="LoRA scale numerator: the update is alpha/r * B A x.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    targets: list[Literal[LORA_TARGETS]] = Field(  # type: ignore[valid-type]
        ["attn"], description="Projections with adapters: attn (wq, wk, wv, wo; with model."
                              "attention: mla q_proj or q_a_proj and q_b_proj, "
                              "kv_a_proj_with_mqa, kv_b_proj, o_proj), shared (the "
                              "shared expert's w1, w2, w3), experts (every routed expert's "
                              "w1, w2, w3, grouped), mlp (the dense MLP's w1, w2, w3: "
                              "model.first_k_dense), linear_attn (gated DeltaNet's in_proj_qkvz, in_proj_ba, "
                              "out_proj: model.gated_delta_layers), or one of them, e.g. attn.wq.")

    @property
    def uses_lora(self) -> bool:
        """Whether LoRA is on (``method: lora``): adapters are built and the base is frozen.
        The one test of it (the model side's ``lora_options``, the freeze rule, the engine)."""
        return self.method == "lora"
