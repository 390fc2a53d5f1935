"""Model buffers: model state that is checkpointed but never optimized (docs/grouping.md);
not the optimizer's flat parameter buffers (``moezero.zero.flat``).

The router's aux-loss-free expert bias (``layers.{i}.moe.router.expert_bias``, DeepSeek-V3) is
state the forward reads and that changes after every optimizer step, by a rule outside the
optimizer (``moezero.model.router.update_expert_biases``; reference:
``moezero.reference.moe.update_expert_bias``). So it is in no optimizer group: no gradient,
no Adam moments, no weight decay, never sharded (every rank holds it whole and updates it
identically from the global expert loads). The checkpoint layout stores it once, fp32, in its
own file ``buffers.safetensors`` (``plan_layout(..., buffers=...)``), written by rank 0.

Both sides decide what is a buffer with ``is_buffer``: torch checkpoints the module buffers it
names (torch's own non-persistent counters are not), the reference keeps them in its params
tree and leaves them out of the optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping

BUFFER_SUFFIXES = (".expert_bias",)
BUFFERS_FILE = "buffers.safetensors"


def is_buffer(fqn: str) -> bool:
    """True for the FQN of checkpointed, never-optimized state (the expert bias)."""
    return fqn.endswith(BUFFER_SUFFIXES)


def split_buffers(shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict, dict]:
    """``(params, buffers)``: a ``{fqn: shape}`` mapping split by ``is_buffer``."""
    params = {k: v for k, v in shapes.items() if not is_buffer(k)}
    return params, {k: v for k, v in shapes.items() if is_buffer(k)}
