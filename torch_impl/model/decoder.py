"""A Mixtral-style decoder: RMSNorm, RoPE, causal attention, SwiGLU experts in MoE layers,
with the options of the Hugging Face families moezero imports (docs/hf.md): grouped-query
attention, QK-norm and projection biases (``model/attention.py``), router variants
(``model/router.py``), shared experts (``model/shared.py``) and dense first layers
(``model/dense.py``). Each block composes the layer kinds ``model/kinds.py`` chooses for it
(``model/kind.py``; docs/model.md, "Adding a layer kind").

Semantics and FQNs are docs/model.md; the JAX counterpart is ``reference/model.py``.
Legend: B batch, S sequence, D model dim, H heads, K head dim, V vocab.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from moezero.model.args import ModelArgs
from moezero.model.attention import Attention, RMSNorm, rope
from moezero.model.head import Head
from moezero.model.kind import Placement
from moezero.model.kinds import layer_kinds
from moezero.model.packing import IGNORE, DocumentMask, document_mask, masked_cross_entropy

__all__ = ["Attention", "Block", "Decoder", "ModelArgs", "RMSNorm", "init_weights", "rope"]


class Block(nn.Module):
    """One decoder layer: ``h + attn(attn_norm(h))``, then ``+ mlp(ffn_norm(·))``, the
    attention and MLP kinds chosen for layer ``layer`` by ``moezero.model.kinds.layer_kinds``.
    Each kind's modules are registered under their own names (``attn``, ``moe`` and
    ``shared``, ``mlp``), so FQNs read ``layers.N.attn.wq.weight``. Returns (h, the layer's
    weighted aux loss, or None for an MLP kind without one)."""

    def __init__(self, args: ModelArgs, *, layer: int = 0, ep_rank: int = 0, ep_group=None):
        super().__init__()
        self.attention_kind, self.mlp_kind = layer_kinds(args, layer)
        at = Placement(layer, ep_rank, ep_group)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self._register(self.attention_kind.build(args, at))
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self._register(self.mlp_kind.build(args, at))

    def _register(self, modules: dict[str, nn.Module]) -> None:
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(self, h: torch.Tensor,
                docs: DocumentMask | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = h + self.attention_kind.apply(self, self.attn_norm(h), docs)
        y, aux = self.mlp_kind.apply(self, self.ffn_norm(h))
        return h + y, aux


class Decoder(nn.Module):
    """Token ids [B, S] -> logits [B, S, V]; ``loss`` adds the MoE aux losses."""

    def __init__(self, args: ModelArgs, *, ep_rank: int = 0, ep_group=None):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, layer=i, ep_rank=ep_rank, ep_group=ep_group)
                                    for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = Head(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens_BS: torch.Tensor, documents_BS: torch.Tensor | None = None,
                targets_BS: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits_BSV, summed weighted aux loss of all MoE layers). ``documents_BS``:
        document labels of a packed row; each document then attends only within itself
        (``moezero.model.packing``). With ``targets_BS`` (``IGNORE``: masked) the first is
        instead their summed fp32 cross-entropy, ``loss_chunk_tokens`` at a time
        (``model.head``)."""
        h = self.embed(tokens_BS)
        docs = None if documents_BS is None else document_mask(documents_BS.to(h.device))
        aux_total = torch.zeros((), device=h.device)
        for layer in self.layers:
            h, aux = layer(h, docs)
            if aux is not None:  # a dense layer has none
                aux_total = aux_total + aux
        if targets_BS is not None:
            return self.lm_head(self.norm(h), targets_BS, self.args.loss_chunk_tokens), aux_total
        return self.lm_head(self.norm(h)), aux_total

    def loss(self, batch_BS1: torch.Tensor, *, loss_mask_BS: torch.Tensor | None = None,
             documents_BS: torch.Tensor | None = None,
             divisor=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Next-token cross-entropy of a [B, S+1] batch plus the aux losses.

        Without ``loss_mask_BS``: the mean over all B·S targets. With it (True = trained):
        the sum over trained targets divided by ``divisor`` (default: their number here);
        the engine passes the step's global count (docs/data.md). ``trained`` counts them.
        With ``model.loss_chunk_tokens`` the logits are never whole (``model.head``).
        """
        if self.args.loss_chunk_tokens:
            return self._chunked_loss(batch_BS1, loss_mask_BS, documents_BS, divisor)
        logits_BSV, aux = self(batch_BS1[:, :-1], documents_BS)
        targets_BS = batch_BS1[:, 1:]
        if loss_mask_BS is None:
            ce = F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())
            trained = torch.tensor(float(targets_BS.numel()), device=ce.device)
        else:
            mask_BS = loss_mask_BS.to(device=targets_BS.device, dtype=torch.bool)
            ce = masked_cross_entropy(logits_BSV, targets_BS, mask_BS, divisor)
            trained = mask_BS.sum().float()
        return ce + aux, {"ce": ce.detach(), "aux_loss": aux.detach(), "trained": trained}

    def _chunked_loss(self, batch_BS1, loss_mask_BS, documents_BS, divisor):
        """``loss`` with the head's cross-entropy summed ``loss_chunk_tokens`` at a time."""
        targets_BS = batch_BS1[:, 1:]
        mask_BS = torch.ones_like(targets_BS, dtype=torch.bool) if loss_mask_BS is None \
            else loss_mask_BS.to(device=targets_BS.device, dtype=torch.bool)
        total, aux = self(batch_BS1[:, :-1], documents_BS, torch.where(mask_BS, targets_BS, IGNORE))
        trained = mask_BS.sum().float()
        if divisor is None or loss_mask_BS is None:  # the mean over the targets here
            divisor = trained.clamp(min=1)
        ce = total / divisor
        return ce + aux, {"ce": ce.detach(), "aux_loss": aux.detach(), "trained": trained}


_OUTPUT_PROJECTIONS = ("wo.weight", "w2.weight", "o_proj.weight")
"""Weights init at std/sqrt(2L): attention's output (``wo``; MLA's ``o_proj``) and SwiGLU's."""


def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic init keyed by FQN: the same weights for any world size or EP layout.

    Norm gains are 1, biases and attention sinks 0; output projections (``wo``, MLA's ``o_proj``,
    ``w2``) get std/sqrt(2L)
    (docs/model.md). LoRA adapters (``moezero.model.lora``): ``lora_B`` 0, ``lora_A``
    uniform in ±1/sqrt(in) (PEFT's default, kaiming-uniform with a = sqrt(5)).
    """
    n_layers = getattr(getattr(model, "args", None), "n_layers", 1)
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            if fqn.endswith((".bias", ".lora_B", ".sinks")):
                param.zero_()
                continue
            if param.ndim == 1:
                param.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(fqn.encode()))
            if fqn.endswith(".lora_A"):
                param.copy_((torch.rand(param.shape, generator=gen) * 2 - 1) / math.sqrt(param.shape[1]))
                continue
            scale = std / math.sqrt(2 * n_layers) if fqn.endswith(_OUTPUT_PROJECTIONS) else std
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
