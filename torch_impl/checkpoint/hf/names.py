"""moezero FQNs ↔ Hugging Face keys of one family (the mapping table of docs/hf.md).

A layer's names are its norms' (here) and its kinds' (each kind declares its own beside it,
``moezero.model.kinds.hf_layer_names``); the routed experts' are the family's
(``Family.expert_names``), per expert on disk or fused in transformers 5's memory."""

from __future__ import annotations

import re

from moezero.checkpoint.hf.arch import Arch
from moezero.checkpoint.hf.family import Family
from moezero.model.kinds import hf_layer_names
from moezero.plan.store import CheckpointError

_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_NORMS = {"attn_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_IN_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"layers\.(\d+)\.moe\.experts\.(\d+)\.(w[123])\.weight")
_W = ("w1", "w3", "w2")
def hf_name(fqn: str, family: Family) -> str:
    """The Hugging Face key of a moezero FQN, in the per-expert on-disk form that every
    transformers version reads (``{moe_block}.experts.{e}.{gate|up|down name}.weight``)."""
    if fqn in _TOP:
        return _TOP[fqn]
    expert = _EXPERT.fullmatch(fqn)
    if expert:
        layer, e, w = expert.groups()
        name = family.expert_names[_W.index(w)]
        return f"model.layers.{layer}.{family.moe_block}.experts.{e}.{name}.weight"
    block = _IN_BLOCK.fullmatch(fqn)
    names = {**_NORMS, **hf_layer_names(family.moe_block, family.shared_block)} if block else {}
    if block and block[2] in names:
        return f"model.layers.{block[1]}.{names[block[2]]}"
    raise CheckpointError(f"parameter {fqn} has no Hugging Face {family.model_type} counterpart")


def candidates(fqn: str, arch: Arch, family: Family) -> list[tuple[str, tuple]]:
    """(HF key, leading-index slices) that may hold ``fqn``, preferred first: the per-expert
    on-disk form, then transformers 5's fused in-memory form (``mlp.experts.gate_up_proj``
    [E, 2F, D] = gate then up, ``mlp.experts.down_proj`` [E, D, F], ``mlp.gate``)."""
    if fqn == "lm_head.weight" and arch.tie_embeddings:
        return [("model.embed_tokens.weight", ())]
    found = [(hf_name(fqn, family), ())]
    expert = _EXPERT.fullmatch(fqn)
    if expert:
        layer, e, w = expert[1], int(expert[2]), expert[3]
        fused, f = f"model.layers.{layer}.mlp.experts.", arch.ffn_dim
        found.append({"w1": (fused + "gate_up_proj", (slice(e, e + 1), slice(0, f))),
                      "w3": (fused + "gate_up_proj", (slice(e, e + 1), slice(f, 2 * f))),
                      "w2": (fused + "down_proj", (slice(e, e + 1),))}[w])
    elif fqn.endswith(".moe.router.weight") and family.moe_block != "mlp":
        found.append((f"model.layers.{fqn.split('.')[1]}.mlp.gate.weight", ()))
    return found


def locate(fqn: str, options: list[tuple[str, tuple]], files, where) -> tuple[str, tuple]:
    """The first of ``options`` (``candidates``) whose key is among ``files``; one-line
    CheckpointError naming ``fqn`` and the keys looked for when none is."""
    found = next(((k, i) for k, i in options if k in files), None)
    if found is None:
        raise CheckpointError(f"{where}: no tensor for {fqn} (looked for "
                              f"{' or '.join(dict.fromkeys(k for k, _ in options))})")
    return found
