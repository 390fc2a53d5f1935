"""Tests of the pure plan (``moezero.plan``): no JAX and no torch anywhere in their imports."""
