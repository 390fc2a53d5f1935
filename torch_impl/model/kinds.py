"""The layer kinds by name, and which ones each decoder layer takes (the one place the config
chooses them). A new kind is one module defining its ``AttentionKind`` or ``MlpKind``
(``moezero.model.kind``) plus a line here; docs/model.md, "Adding a layer kind".
"""

from __future__ import annotations

from moezero.model.args import ModelArgs
from moezero.model.attention import GQA
from moezero.model.dense import DENSE
from moezero.model.gated_delta import GATED_DELTA
from moezero.model.kind import AttentionKind, MlpKind
from moezero.model.mla import MLA_KIND
from moezero.model.moe_mlp import MOE

ATTENTION_KINDS: dict[str, AttentionKind] = {k.name: k for k in (GQA, MLA_KIND, GATED_DELTA)}
MLP_KINDS: dict[str, MlpKind] = {k.name: k for k in (MOE, DENSE)}


def layer_kinds(args: ModelArgs, layer: int) -> tuple[AttentionKind, MlpKind]:
    """Layer ``layer``'s (attention kind, MLP kind): gated DeltaNet in ``gated_delta_layers``,
    ``args.attention`` (grouped-query or latent attention) elsewhere; the dense MLP in layers
    below ``first_k_dense``, the MoE layer above."""
    attention = "gated_delta" if layer in args.gated_delta_layers else args.attention
    return ATTENTION_KINDS[attention], MLP_KINDS["dense" if layer < args.first_k_dense else "moe"]


def hf_layer_names(moe_block: str, shared: str = "shared_expert") -> dict[str, str]:
    """Every kind's ``{FQN within a layer: Hugging Face key within a layer}``, ``{moe_block}``
    and ``{shared}`` (the family's shared-expert name) filled in. Raises ValueError if two
    kinds claim one FQN for different keys."""
    names: dict[str, str] = {}
    for kind in (*ATTENTION_KINDS.values(), *MLP_KINDS.values()):
        for fqn, key in kind.hf_names.items():
            key = key.format(moe_block=moe_block, shared=shared)
            if names.setdefault(fqn, key) != key:
                raise ValueError(f"layer kind {kind.name}: {fqn} is already {names[fqn]}")
    return names
