"""Helpers shared by every test suite (``tests/*`` and ``parity_tests``), one copy each.

- ``compare``: flatten either side to ``{fqn: np.ndarray}`` and compare by FQN (optax's
  ``test_utils`` idea); imports neither torch nor JAX itself.
- ``world``: ``run_world``, a function on W gloo ranks with a fresh rendezvous (torch).
- ``jax_env``: the XLA flags a JAX suite sets before JAX is first imported.

Tolerances stay per suite (``tests/torch_impl/tolerances.py``,
``tests/reference/tolerances.py``, ``parity_tests/tolerances.py``; STYLE.md, Tests).
"""
