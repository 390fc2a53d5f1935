"""Models: the expert-agnostic MoE layer and the Mixtral-style decoder built from it."""

from moezero.model.args import ModelArgs, model_args
from moezero.model.decoder import Decoder, init_weights
from moezero.model.moe import MoE, SwiGLU, expert_tag

__all__ = ["Decoder", "ModelArgs", "MoE", "SwiGLU", "expert_tag", "init_weights", "model_args"]
