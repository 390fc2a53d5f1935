"""Benchmarks of moezero beside its peers (FSDP2 + DCP, DeepSpeed), measured in one run.

``python -m benchmarks.run [--quick]`` drives everything and writes ``BENCHMARKS.md``; each
configuration trains in fresh processes started by ``torchrun`` (``benchmarks.worker``).
Not tests: nothing here asserts, it measures and reports.
"""
