"""moezero's reference half: the executable specification (JAX on top of ``reference.plan``).

Importing this package imports nothing else, so ``reference.plan`` (stdlib + numpy) can be
used by the torch side without JAX installed.
"""
