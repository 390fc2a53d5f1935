"""Models: the expert-agnostic MoE layer and the Mixtral-style decoder built from it."""

from moezero.model.decoder import Decoder, ModelArgs, init_weights
from moezero.model.moe import MoE, SwiGLU, expert_tag

__all__ = ["Decoder", "ModelArgs", "MoE", "SwiGLU", "expert_tag", "init_weights"]
