"""What one Hugging Face MoE family is to moezero: its ``config.json`` reader and writer, its
on-disk tensor names, and what of moezero's architecture it cannot hold.

One module per family (``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``, ``glm4_moe``)
defines a ``FAMILY``; ``families`` lists them and picks one for a ``model_type`` or an ``Arch``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from moezero.checkpoint.hf.arch import Arch

EXPORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Family:
    """A Hugging Face MoE family.

    Attributes:
        model_type: ``config.json``'s ``model_type``.
        architecture: The ``*ForCausalLM`` class ``from_pretrained`` builds.
        moe_block: The MoE block's name in a layer on disk (``block_sparse_moe``, ``mlp``).
        expert_names: The on-disk names of moezero's ``w1``, ``w3``, ``w2`` (gate, up, down).
        read: ``(config.json object, where) -> Arch``; one-line CheckpointError on what
            moezero cannot represent.
        write: ``Arch -> {key: value}``: the family's own ``config.json`` keys.
        refusal: ``Arch -> (moezero key, value, why) or None``: what the family cannot hold.
        source: ``(fqn, shape, arch, tensors, where) -> (key, index) | Derived | None``: where
            a tensor comes from when the names table cannot say (fused, interleaved,
            quantized hub layouts, Qwen3-Next's ``1 + w`` gains); None: the names table.
        export_items: ``(fqn shapes, arch) -> [(key, fqn or composer, shape)]``: the
            exported tensors when they are not one per FQN as they are (a composer
            ``read -> parts`` transforms or fuses them: ``tools.write_weights``).
        shared_block: The shared expert's name in the MoE block (``mlp.<name>.gate_proj``).
        holds: the architecture features (``families.FEATURES``: sigmoid routing, the expert
            bias, dense first layers, partial rotary, latent attention, Qwen3-Next's hybrid
            layers, gpt-oss's sinks, biases, clamp, window and YaRN, ...) the family holds;
            ``families.family_for`` refuses every other one that is on, then its
            ``refusal`` checks what the family needs of them and of the rest.
        dropped: ``config.json object -> (pattern, note) or None``: the keys the import
            drops on purpose (DeepSeek-V3's multi-token-prediction layers) and the note it
            prints about them.
        peft_as_parameters: Module-name endings that a PEFT export names as
            ``target_parameters`` (``<module>.weight``) instead of ``target_modules``: PEFT
            (0.21, transformers 5) retargets a module target with such an ending to the fused
            experts for the families converted like Qwen2-MoE (GLM-4.5, DeepSeek-V3).
        carried: the source keys import-hf carries through unchanged and export writes back
            (Qwen3.5-MoE's vision tower and MTP weights; ``carried.py``), or None.
        nest_config: ``(exported config, the source's config.json) -> config.json`` of a
            family that carries (its language model's keys nested in ``text_config``).
        peft_keys: ``(adapter tensors, target modules, Arch) -> (tensors, modules)``: a PEFT
            export as the text-only families name it, renamed to the family's own layout.
        import_dtype: the import's dtype when ``--dtype`` is not given (None: the source's);
            Qwen3-Next's ``fp32``, which holds its gains' ``1 + w`` exactly.
        interleaved_gate_up: its fused ``gate_up_proj`` interleaves gate and up (gpt-oss:
            gate = ``[..., 0::2]``, up = ``[..., 1::2]``) instead of gate then up; a PEFT
            export interleaves its gate_up adapter's output rows the same way.
    """

    model_type: str
    architecture: str
    moe_block: str
    expert_names: tuple[str, str, str]
    read: Callable[[dict, str], Arch]
    write: Callable[[Arch], dict]
    refusal: Callable[[Arch], tuple[str, object, str] | None]
    source: Callable | None = None
    export_items: Callable | None = None
    shared_block: str = "shared_expert"
    holds: frozenset[str] = frozenset()
    dropped: Callable[[dict], tuple[re.Pattern, str] | None] | None = None
    peft_as_parameters: tuple[str, ...] = ()
    carried: re.Pattern | None = None
    nest_config: Callable[[dict, dict], dict] | None = None
    peft_keys: Callable | None = None
    import_dtype: str | None = None
    interleaved_gate_up: bool = False

    def config(self, arch: Arch, dtype: str) -> dict:
        """The exported ``config.json``: the keys every family shares, then its own."""
        torch_dtype = EXPORT_DTYPES[dtype]
        return {"architectures": [self.architecture], "model_type": self.model_type,
                "vocab_size": arch.vocab_size, "hidden_size": arch.dim,
                "num_hidden_layers": arch.n_layers, "num_attention_heads": arch.n_heads,
                "num_key_value_heads": arch.n_kv_heads, "head_dim": arch.head_dim,
                "hidden_act": "silu", "rms_norm_eps": arch.norm_eps,
                "rope_theta": arch.rope_theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta},
                "num_experts_per_tok": arch.top_k, "tie_word_embeddings": False,
                "attention_dropout": 0.0, "output_router_logits": False,
                **self.write(arch), "dtype": torch_dtype, "torch_dtype": torch_dtype}


def token_ids(arch: Arch, **ids: int) -> dict:
    """The family's default special-token ids, each None where the vocabulary is too small."""
    return {k: v if v < arch.vocab_size else None for k, v in ids.items()}


def sliding(cfg: dict, key: str = "use_sliding_window") -> tuple[str, object] | None:
    """``(key, value)`` when the config turns a sliding attention window on, else None."""
    if key == "sliding_window":
        window, positions = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
        on = window not in (None, 0) and (positions is None or window < positions)
        return (key, window) if on else None
    return (key, cfg[key]) if cfg.get(key) else None
