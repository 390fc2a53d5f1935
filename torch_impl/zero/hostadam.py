"""The AdamW step every tier and stage runs: one pass over each element's state.

``adamw_step_`` updates an fp32 master and its moments from a gradient in any compute dtype,
multiplied on the way by ``grad_mul`` (the loss-scale unscale times the clip coefficient), and
can write the updated master's downcast (the compute-dtype param) in the same pass. Each
element's gradient, master and moments are read once and written once: 28 B per element in
fp32 (DeepSpeedCPUAdam's budget), against ten passes for the vectorised AdamW it replaced
(``benchmarks/adamw_foreach.py``).

Two implementations of the same formula (``compiled`` picks; the optimizer asks for the
compiled one):

- ``compiled``: ``csrc/adamw_host.cpp``, built with ``torch.utils.cpp_extension`` at first use
  into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``)
  under a name that carries this CPU's instruction set, so a cache shared by unlike machines
  never loads a foreign build; a build stamped current (``kernel_cache``) is imported without
  ``torch.utils.cpp_extension`` (~11 MiB per rank). CPU tensors only.
- ``torch``: the same operations as torch ops, chunked (bounded temporaries), for CUDA tensors
  and where the build fails (no compiler or ninja; ``load_compiled`` says why).

Why a compiled kernel and not ``torch._fused_adamw_`` (what ``torch.optim.AdamW(fused=True)``
runs on CPU): that kernel takes fp32 gradients only (a bf16 gradient needs an upcast pass),
cannot write the bf16/fp16 param, and its vectorised body and scalar tail round differently, so
an element's result depends on where a tier's slicing puts it. This kernel is built with
``-ffp-contract=off`` and without fast-math: an element's result is the same wherever it lies,
so the tiers and stages, which slice the state differently, stay bit-identical. Measured in
``benchmarks.hoststep`` (BENCHMARKS.md, the ``hoststep`` series).

Semantics (optax ``adamw``, ``reference/optim.py``), per element, in fp32::

    g = grad * grad_mul
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * (g * g)
    u = (m * ib1) / (sqrt(v * ib2) + eps) + weight_decay * p    (ib_i = 1 / (1 - beta_i ** step))
    p = p - lr * u

Equal to the per-tensor torch ops of the reference's math (``tests/support/adamw.py``) to fp32
rounding (tests/torch_impl/test_hostadam.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch

from moezero.zero import kernel_cache

__all__ = ["adamw_step_", "load_compiled", "square_sum"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "adamw_host.cpp"
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno"]
CHUNK = 1 << 20  # elements per chunk of the torch implementation (its temporaries: ~5 of these)


@functools.cache
def load_compiled(source: Path = SOURCE) -> tuple[object | None, str]:
    """(the built extension module, "") or (None, why it could not be built or loaded: logged
    once as a warning, and every step runs the torch ops)."""
    name = f"moezero_{source.stem}_{_cpu_tag()}"
    try:
        built = kernel_cache.find(name, source, CFLAGS)
        if built is not None:  # current: no need to import cpp_extension (kernel_cache)
            return kernel_cache.import_library(name, built), ""
        with kernel_cache.exclusive(name) as held:  # one builder; a killed build's lock cleared
            built = kernel_cache.find(name, source, CFLAGS)  # built while this one waited?
            if built is not None:
                return kernel_cache.import_library(name, built), ""
            return _build(name, source, held), ""
    except Exception as e:  # any build failure falls back to torch ops
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        why = f"{type(e).__name__}: {lines[-1] if lines else ''}"
        log.warning("the compiled AdamW kernel (%s) is not available, the step runs torch ops "
                    "(slower): %s", source, why)
        return None, why


def _build(name: str, source: Path, held):
    """Build (or check with ninja) ``source`` as ``name`` in a child process holding the build
    lock ``held`` too (``kernel_cache.build``), and import it."""
    return kernel_cache.import_library(name, kernel_cache.build(name, source, CFLAGS, held))


def _cpu_tag() -> str:
    """A short digest of this CPU's model and instruction-set flags (-march=native builds)."""
    info = platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info += "".join(line for line in lines if line.startswith(("flags", "model name"))
                        )[:4096]
    except OSError:
        info += platform.processor()
    return hashlib.sha1(info.encode()).hexdigest()[:10]


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, grad_mul: float = 1.0,
                out: torch.Tensor | None = None, compiled: bool = True) -> None:
    """One AdamW update in place on the fp32 ``param``/``exp_avg``/``exp_avg_sq`` from
    ``grad * grad_mul`` (fp32, bf16 or fp16, same numel); ``step`` is 1-based. ``out``: also
    write the updated param there (its dtype), in the same pass; it may be ``grad``'s own
    storage (each element's gradient is read before its ``out`` is written). ``compiled``:
    the compiled kernel for CPU tensors where it builds (else, and on CUDA, torch ops)."""
    hyper = (float(grad_mul), float(lr), float(beta1), float(beta2), float(eps),
             float(weight_decay), 1.0 / (1.0 - beta1 ** step), 1.0 / (1.0 - beta2 ** step))
    module = load_compiled()[0] if compiled and not param.is_cuda else None
    if module is not None:
        _check_disjoint(param, exp_avg, exp_avg_sq, grad)
        module.adamw_step(param, grad, exp_avg, exp_avg_sq, out, *hyper)
        return
    for lo in range(0, param.numel(), CHUNK):
        sl = slice(lo, lo + CHUNK)
        _torch_step(param[sl], grad[sl], exp_avg[sl], exp_avg_sq[sl],
                    None if out is None else out[sl], *hyper)


def _torch_step(p, g, m, v, out, grad_mul, lr, beta1, beta2, eps, weight_decay, ib1, ib2) -> None:
    """The kernel's operations as torch ops (no fused multiply-adds: the same roundings)."""
    g = g.float()
    if grad_mul != 1.0:
        g = g * grad_mul
    m.mul_(beta1).add_(g * (1.0 - beta1))
    v.mul_(beta2).add_((g * g).mul_(1.0 - beta2))
    u = (m * ib1).div_((v * ib2).sqrt_().add_(eps))
    if weight_decay:
        u.add_(p * weight_decay)
    p.sub_(u.mul_(lr))
    if out is not None:
        out.copy_(p)


def _check_disjoint(*tensors: torch.Tensor) -> None:
    """The compiled kernel's master, moments and gradient must not share memory (it vectorises
    on that; ``out`` may be the gradient's storage)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors if t.numel())
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:], strict=False)):
        raise ValueError("adamw_step_: master, exp_avg, exp_avg_sq and grad overlap in memory")


def square_sum(grad: torch.Tensor):
    """(fp64 sum of the fp32 squares, count of non-finite elements) of a gradient in any float
    dtype, in one pass on the CPU (the compiled kernel's eight running sums, the same for the
    same values wherever they lie) or as torch ops (CUDA, or no build: tensors, no sync)."""
    module = load_compiled()[0] if not grad.is_cuda else None
    if module is not None:
        return module.square_sum(grad.contiguous())
    g32 = grad.float()
    return g32.square().sum(dtype=torch.float64), torch.isfinite(g32).logical_not_().sum()
