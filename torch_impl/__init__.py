"""moezero's production path: MoE training with ZeRO-sharded data parallelism in PyTorch.

Imports nothing from JAX; the only code shared with the reference is ``reference.plan``.
"""

__version__ = "0.1.0"
