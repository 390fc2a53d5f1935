"""The DeepSpeed peer: the same decoder with DeepSpeed's native ``deepspeed.moe.layer.MoE``.

Attention, norms, embedding and the SwiGLU expert are moezero's modules; only the MoE layer is
DeepSpeed's, set to match moezero's routing as closely as it allows: top-k from the spec,
no token dropping (infinite capacity), no random token selection, deterministic second expert.
Its aux loss is DeepSpeed's (first-choice load balancing), weighted 0.01 like moezero's.
Runs in the peer venv with ``DS_ACCELERATOR=cpu``; ZeRO stage from the spec's options;
``torch_adam`` so no op is built.
"""

from __future__ import annotations

import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from torch import nn

from benchmarks.common import INIT_STD, make_batches, model_args
from moezero.model.decoder import Attention, ModelArgs, RMSNorm, init_weights
from moezero.model.moe import SwiGLU

AUX_LOSS_COEF = 0.01


class PeerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(args.dim, SwiGLU(args.dim, args.ffn_dim), num_experts=args.num_experts,
                       ep_size=args.ep_size, k=args.top_k, drop_tokens=False, use_rts=False,
                       top2_2nd_expert_sampling=False)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + self.attn(self.attn_norm(h))
        y, aux, _ = self.moe(self.ffn_norm(h))
        return h + y, aux


class PeerDecoder(nn.Module):
    """The peer's own decoder (DeepSpeed's MoE layer in place of moezero's): token ids
    [B, S+1] -> mean next-token cross-entropy + weighted aux losses."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(PeerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, batch_BS1: torch.Tensor) -> torch.Tensor:
        h = self.embed(batch_BS1[:, :-1])
        aux_total = torch.zeros(())
        for layer in self.layers:
            h, aux = layer(h)
            aux_total = aux_total + aux
        logits_BSV = self.lm_head(self.norm(h))
        ce = F.cross_entropy(logits_BSV.float().flatten(0, 1), batch_BS1[:, 1:].flatten())
        return ce + AUX_LOSS_COEF * aux_total


def ds_config(spec: dict) -> dict:
    train = spec["train"]
    return {
        "train_micro_batch_size_per_gpu": train["micro_batch_size"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": train["lr"], "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": 0.1,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": spec["options"].get("stage", 2)},
        "steps_per_print": 10**9,
    }


class DeepSpeedTrainer:
    """``deepspeed.initialize`` on the decoder; ``engine.backward`` / ``engine.step``."""

    def __init__(self, spec: dict):
        deepspeed.init_distributed(dist_backend="gloo")
        train = spec["train"]
        model = PeerDecoder(model_args(spec["model"], ep_size=spec["model"]["ep_size"]))
        init_weights(model, train["seed"], INIT_STD)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(spec))
        self.batches = make_batches(train, rank=dist.get_rank(), world=dist.get_world_size())
        self.save_note = None
        self.info = {"optimizer_elements": self._elements(), "deepspeed": deepspeed.__version__,
                     "step_call": "engine.step() (optimizer + parameter all-gather)",
                     "torch": torch.__version__}

    def _elements(self) -> int | None:
        groups = getattr(self.engine.optimizer, "single_partition_of_fp32_groups", None)
        return sum(t.numel() for t in groups) if groups else None

    def step(self, batch_BS1: torch.Tensor) -> tuple[float, float]:
        loss = self.engine(batch_BS1)
        self.engine.backward(loss)
        start = time.perf_counter()
        self.engine.step()
        return loss.item(), time.perf_counter() - start

    def save(self, folder: str) -> None:
        self.engine.save_checkpoint(folder)

    def load(self, folder: str) -> None:
        self.engine.load_checkpoint(folder)
