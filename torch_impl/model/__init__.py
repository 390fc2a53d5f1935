"""Models: the expert-agnostic MoE layer and the Mixtral-style decoder built from it."""

from torch_impl.model.decoder import Decoder, ModelArgs, init_weights
from torch_impl.model.moe import MoE, SwiGLU, expert_tag

__all__ = ["Decoder", "ModelArgs", "MoE", "SwiGLU", "expert_tag", "init_weights"]
