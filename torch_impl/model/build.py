"""The one place a decoder is built: settings + where + adapters + EP rank -> the model.

``build_decoder`` takes ``ModelArgs`` (benchmarks' peer venvs and the parity tests have no run
config); ``config_decoder`` takes a run ``Config`` and reads the adapters (``peft``) and the
init (``train.seed``, ``model.init_std``) from it. ``where``:

- ``"meta"``: shapes, dtypes, FQNs, expert tags and ``requires_grad``, no storage; built under
  ``moezero.model.meta.on_meta``, so no initialiser runs (and the ~70 MiB of imports a meta
  fill costs are never paid). The engine materialises it shard by shard
  (``moezero.model.materialize``) from ``config_init``.
- a device (``"cpu"``, ``torch.device("cuda")``, ...): parameters with storage there, filled by
  ``init`` (``init_weights``, keyed by FQN: the same values for any W, ep and device), or by
  the modules' own initialisers from torch's global generator when ``init`` is None (callers
  that load a state dict next, or only measure).

Adapters (``moezero.model.lora``) are added before the init, so ``lora_B`` starts at zero.
``ep_rank`` picks the experts the model holds (``ep_size`` is in the settings) and
``ep_group`` is the process group its MoE layers exchange tokens over (None: one process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from moezero.model.args import ModelArgs, model_args
from moezero.model.decoder import Decoder, init_weights
from moezero.model.lora import LoraOptions, apply_lora, lora_options
from moezero.model.materialize import KeyedInit
from moezero.model.meta import on_meta

if TYPE_CHECKING:  # the model imports no pydantic (benchmarks' peer venvs build it bare)
    from moezero.config import Config

__all__ = ["Where", "build_decoder", "config_decoder", "config_init"]

Where = Literal["meta"] | str | torch.device
"""``"meta"`` (no storage, no init) or the device the parameters are made on."""


def build_decoder(args: ModelArgs, *, where: Where = "meta", lora: LoraOptions | None = None,
                  init: KeyedInit | None = None, ep_rank: int = 0, ep_group=None) -> Decoder:
    """The decoder of ``args`` holding EP rank ``ep_rank``'s experts, with ``lora``'s adapters
    (None: none), on ``where``; materialised models are filled by ``init`` (None: the
    modules' own initialisers)."""
    if _is_meta(where):
        if init is not None:
            raise ValueError("build_decoder: a meta model holds no values; pass init=None "
                             "and materialise it with that init (moezero.model.materialize)")
        with on_meta():
            return _build(args, lora, ep_rank, ep_group)
    with torch.device(where):
        model = _build(args, lora, ep_rank, ep_group)
    if init is not None:
        init_weights(model, init.seed, init.std)
    return model


def _is_meta(where: Where) -> bool:
    return torch.device(where).type == "meta"


def _build(args: ModelArgs, lora: LoraOptions | None, ep_rank: int, ep_group) -> Decoder:
    model = Decoder(args, ep_rank=ep_rank, ep_group=ep_group)
    return apply_lora(model, lora)


def config_decoder(cfg: Config, *, where: Where = "meta", adapters: bool = True,
                   init: bool = True, ep_rank: int = 0, ep_group=None) -> Decoder:
    """``build_decoder`` of a run config: ``model_args(cfg)``, the ``peft`` section's adapters
    when ``adapters`` (False: the base model alone, e.g. for the shapes of a base checkpoint)
    and, materialised, ``config_init(cfg)`` when ``init`` (False: the modules' own)."""
    return build_decoder(model_args(cfg), where=where,
                         lora=lora_options(cfg.peft) if adapters else None,
                         init=config_init(cfg) if init and not _is_meta(where) else None,
                         ep_rank=ep_rank, ep_group=ep_group)


def config_init(cfg: Config) -> KeyedInit:
    """The run's FQN-keyed init: ``train.seed``, ``model.init_std``."""
    return KeyedInit(cfg.train.seed, cfg.model.init_std, model_args(cfg))
