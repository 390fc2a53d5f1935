"""Tree / FQN comparison helpers: both sides flattened to ``{fqn: np.ndarray}`` and compared.

torch modules and state dicts flatten by ``named_parameters`` / keys; reference params by
``moezero.reference.weights.to_fqn_dict`` (experts unstacked by global index), so one FQN names the
same tensor on both sides (docs/model.md). Errors are measured in float64:
``rel_err`` is norm-wise, ``||a − b|| / ||b||``; ``max_abs`` is ``max |a − b|``; ``max_rel`` is
``max |a − b| / max |b|`` (elementwise, on the output's own scale).

Shared by every suite, so it imports neither torch nor JAX: a torch tensor is recognised only
when torch is already loaded (an object cannot be one otherwise), JAX arrays convert through
``np.asarray``, and ``jax_fqns`` imports the reference when called (torch-only suites never
call it).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import numpy as np

# The worst error each check has measured in this session, by check name (the ``what`` of the
# assert helpers up to its first comma): ``{name: (worst, tolerance)}``. conftest prints it
# when PARITY_REPORT=1, which is how tolerances.py's "measured" comments are kept honest.
MEASURED: dict[str, tuple[float, float]] = {}


def record(what: str, err: float, tol: float) -> None:
    """Keep the worst error of check ``what`` (up to its first comma) for PARITY_REPORT."""
    name = what.split(",")[0]
    worst, _ = MEASURED.get(name, (0.0, tol))
    MEASURED[name] = (max(worst, err), tol)


def _torch():
    """The torch module if it is loaded (then a tensor may be one of its tensors), else None."""
    return sys.modules.get("torch")


def to_numpy(x) -> np.ndarray:
    """A torch tensor, JAX array or array-like as a float64 (or integer/bool) numpy array.

    Floating arrays of any width (bf16 from ml_dtypes included) become float64.
    """
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = x.double() if x.is_floating_point() else x
        return x.numpy()
    arr = np.asarray(x)
    return arr if arr.dtype.kind in "biu" else arr.astype(np.float64)


def torch_fqns(tree, *, grads: bool = False) -> dict[str, np.ndarray]:
    """``{fqn: array}`` of a module's parameters (or their ``.grad``), or of a tensor dict."""
    torch = _torch()
    if torch is not None and isinstance(tree, torch.nn.Module):
        named = dict(tree.named_parameters())
        if grads:  # a parameter that took no part (an expert with no tokens) has zero grad
            named = {k: torch.zeros_like(p) if p.grad is None else p.grad
                     for k, p in named.items()}
        tree = named
    return {k: to_numpy(v) for k, v in tree.items()}


def jax_fqns(params: dict) -> dict[str, np.ndarray]:
    """``{fqn: array}`` of a reference params tree (or a grads tree of the same structure)."""
    from moezero.reference.weights import to_fqn_dict  # JAX suites only

    return {k: to_numpy(v) for k, v in to_fqn_dict(params).items()}


def rel_err(a, b) -> float:
    """``||a − b|| / ||b||`` (Frobenius, float64); the plain norm of a − b when b is zero."""
    a, b = to_numpy(a).astype(np.float64), to_numpy(b).astype(np.float64)
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    denom = np.linalg.norm(b.ravel())
    return float(np.linalg.norm((a - b).ravel()) / (denom if denom > 0 else 1.0))


def max_abs(a, b) -> float:
    a, b = to_numpy(a).astype(np.float64), to_numpy(b).astype(np.float64)
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def max_rel(a, b) -> float:
    """``max |a − b| / max |b|``: the worst elementwise error on the scale of the output."""
    scale = float(np.max(np.abs(to_numpy(b)))) if np.size(to_numpy(b)) else 0.0
    return max_abs(a, b) / (scale if scale > 0 else 1.0)


def assert_rel(actual, expected, rtol: float, what: str = "value") -> float:
    """Norm-wise relative error within ``rtol``; returns it."""
    err = rel_err(actual, expected)
    record(what, err, rtol)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"
    return err


def assert_max_abs(actual, expected, atol: float, what: str = "value") -> float:
    """Elementwise ``max |a − b|`` within ``atol``; returns it."""
    err = max_abs(actual, expected)
    record(what, err, atol)
    assert err <= atol, f"{what}: max abs difference {err:.3e} > {atol:.1e}"
    return err


def assert_max_rel(actual, expected, tol: float, what: str = "value") -> float:
    """``max |a − b| / max |b|`` within ``tol``; returns it."""
    err = max_rel(actual, expected)
    record(what, err, tol)
    assert err <= tol, f"{what}: max error / max value {err:.3e} > {tol:.1e}"
    return err


def assert_unequal_fraction(actual, expected, frac: float, what: str = "value") -> float:
    """The fraction of elements that are not bit-equal is at most ``frac``; returns it."""
    a, b = to_numpy(actual), to_numpy(expected)
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    err = float(np.mean(a != b)) if a.size else 0.0
    record(what, err, frac)
    assert err <= frac, f"{what}: {err:.1%} of elements differ (at most {frac:.1%} may)"
    return err


def assert_same_fqns(actual: Mapping, expected: Mapping) -> None:
    only_a, only_e = sorted(actual.keys() - expected.keys()), sorted(expected.keys() - actual.keys())
    assert not only_a and not only_e, f"FQNs differ: only actual {only_a[:5]}, only expected {only_e[:5]}"


def errors_by_fqn(actual: Mapping, expected: Mapping) -> list[tuple[float, str]]:
    """``(rel_err, fqn)`` for every FQN, worst first (same FQN sets required)."""
    assert_same_fqns(actual, expected)
    return sorted(((rel_err(actual[k], expected[k]), k) for k in expected), reverse=True)


def assert_close_by_fqn(actual: Mapping, expected: Mapping, rtol: float,
                        what: str = "tensors") -> float:
    """Same FQNs and every tensor within ``rtol`` norm-wise; returns the worst error."""
    worst = errors_by_fqn(actual, expected)
    record(what, worst[0][0], rtol)
    shown = ", ".join(f"{k}: {e:.3e}" for e, k in worst[:3])
    assert worst[0][0] <= rtol, f"{what}: largest relative errors (rtol {rtol:.1e}): {shown}"
    return worst[0][0]
