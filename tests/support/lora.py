"""moezero's own logits of a LoRA run: the base checkpoint's weights and the run's adapters in
one decoder (every expert local), the side the PEFT export tests compare transformers with."""

from __future__ import annotations

from pathlib import Path

import torch

from moezero.config import Config
from moezero.model.build import config_decoder
from moezero.plan import store
from moezero.plan.reading import read_tensors


def lora_logits(base: Path, adapters: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of ``tokens`` [B, S] through the base ``base`` with the adapters of the
    checkpoint ``adapters`` (both step folders)."""
    manifest = store.read_manifest(adapters)
    cfg = Config.model_validate(manifest.config)
    cfg.moe.ep_size = 1
    model = config_decoder(cfg, where="cpu", init=False).eval()
    state = {**read_tensors(base, store.read_manifest(base)), **read_tensors(adapters, manifest)}
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    with torch.no_grad():
        return model(tokens)[0]
