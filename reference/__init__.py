"""moezero's reference half: the executable specification (JAX on top of ``moezero.plan``).

Importing this package imports nothing else, so ``moezero.plan`` (stdlib + numpy) can be
used by the torch side without JAX installed.
"""
