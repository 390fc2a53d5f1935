"""The ``grouped`` series: grouped-GEMM experts against the per-expert loop, one MoE layer, CPU.

One process, one thread, ep = 1, fp32, dropless: tokens/s of one MoE layer's forward +
backward (the experts' GEMMs dominate) for three paths — the loop (one call per expert), the
grouped GEMMs with the weights copied into a stack (stage 3, a bare model) and with
the weights viewed from a flat buffer laid out as ZeRO stages 0-2 lay it out — at each expert
count of ``size["grouped"]["experts"]``, interleaved over rounds. The copy's own cost (stacking
the three projections once) is timed alone. ``measure`` returns plain data for
``results["grouped"]``; ``section`` renders it for BENCHMARKS.md.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.fmt import table
from moezero.model.experts import SwiGLU, stack_weights, stacking_mode
from moezero.model.moe import MoE

SECTION = "## Grouped-GEMM experts vs the per-expert loop (issue 19)"
PATHS = (("per-expert loop", False, False), ("grouped, weights copied", True, False),
         ("grouped, weights viewed (ZeRO-1/2 layout)", True, True))


def _flat_layout(moe: MoE) -> None:
    """Make the experts' weights views of one buffer in plan order: per expert w1, w2, w3."""
    params = [getattr(m, n).weight for m in moe.experts.values() for n in ("w1", "w2", "w3")]
    flat = torch.empty(sum(p.numel() for p in params))
    pos = 0
    for p in params:
        view = flat[pos:pos + p.numel()].view_as(p)
        view.copy_(p.detach())
        p.data = view
        pos += p.numel()


def _layer(cfg: dict, experts: int, grouped: bool, flat: bool) -> MoE:
    torch.manual_seed(0)
    moe = MoE(cfg["dim"], SwiGLU(cfg["dim"], cfg["ffn_dim"]), num_experts=experts,
              top_k=cfg["top_k"], grouped=grouped)
    if flat:
        _flat_layout(moe)
    want = "view" if flat else "copy"
    if grouped and stacking_mode(list(moe.experts.values())) != want:
        raise AssertionError(f"the {want} row would not measure a {want}")
    return moe


def _step_s(moe: MoE, x: torch.Tensor) -> float:
    moe.zero_grad(set_to_none=True)
    start = time.perf_counter()
    out, aux = moe(x)
    (out.square().mean() + aux).backward()
    return time.perf_counter() - start


def _copy_s(moe: MoE) -> tuple[float, float]:
    """Seconds to stack the three projections into new tensors (what the copy path does) and
    into reused ones (the same bytes without allocating)."""
    weights = [[getattr(m, n).weight.detach() for m in moe.experts.values()]
               for n in ("w1", "w3", "w2")]
    start = time.perf_counter()
    stacks = [stack_weights(ws) for ws in weights]
    fresh = time.perf_counter() - start
    start = time.perf_counter()
    for ws, out in zip(weights, stacks, strict=True):
        torch.stack(ws, out=out)
    return fresh, time.perf_counter() - start


def _one_count(cfg: dict, experts: int) -> list[dict]:
    layers = {name: _layer(cfg, experts, grouped, flat) for name, grouped, flat in PATHS}
    x = torch.randn(cfg["tokens"], cfg["dim"], generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {name: [] for name in layers}
    copies = []
    for _ in range(cfg["rounds"]):
        for name, moe in layers.items():
            _step_s(moe, x)  # warm-up
            times[name].append(statistics.median(_step_s(moe, x) for _ in range(cfg["steps"])))
        copies.append(_copy_s(layers[PATHS[1][0]]))
    copied = PATHS[1][0]
    return [{"experts": experts, "path": name, "step_s": statistics.median(ts),
             "tokens_per_s": cfg["tokens"] / statistics.median(ts),
             "copy_s": statistics.median(c[0] for c in copies) if name == copied else None,
             "copy_reused_s": statistics.median(c[1] for c in copies) if name == copied else None}
            for name, ts in times.items()]


def measure(size: dict) -> dict:
    """Every path at every expert count; restores torch's thread count."""
    cfg, threads = size["grouped"], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [row for e in cfg["experts"] for row in _one_count(cfg, e)]
    finally:
        torch.set_num_threads(threads)
    return {"config": cfg, "rows": rows}


def section(results: dict) -> list[str]:
    """The BENCHMARKS.md section of ``results["grouped"]``."""
    data = results.get("grouped")
    if not data:
        return [SECTION, "", "Not run (`nox -s bench -- --series grouped`)."]
    cfg, rows = data["config"], data["rows"]
    loop = {r["experts"]: r["tokens_per_s"] for r in rows if r["path"] == PATHS[0][0]}
    body = []
    for r in rows:
        copy = (f"{1e3 * r['copy_s']:.1f} ms (twice per step: {200 * r['copy_s'] / r['step_s']:.0f}% "
                f"of it); into a reused buffer {1e3 * r['copy_reused_s']:.1f} ms"
                if r.get("copy_s") is not None else "–")
        body.append([r["experts"], r["path"], f"{r['tokens_per_s']:,.0f}",
                     f"{r['tokens_per_s'] / loop[r['experts']]:.2f}×", f"{1e3 * r['step_s']:.1f}",
                     copy])
    return [SECTION, "",
            f"One MoE layer, forward + backward, fp32, one thread, ep = 1, dropless: "
            f"{cfg['tokens']:,} tokens, dim {cfg['dim']}, SwiGLU experts of width "
            f"{cfg['ffn_dim']}, top-{cfg['top_k']}; median over {cfg['rounds']} interleaved "
            f"rounds of the median of {cfg['steps']} steps. Run: `{results.get('command', '')}` "
            f"({results['machine']['date']}; `nox -s bench -- --series grouped` reruns this "
            "section only).", "",
            *table(["experts", "path", "tokens/s", "vs loop", "step ms",
                    "stacking copy of the weights"], body), "",
            "- The copy is what the grouped path pays where the weights cannot be viewed "
            "(docs/model.md, stacking rule); at ZeRO stages 1-2 the weights are views and it "
            "is zero. The same stack into a reused buffer (last column) shows how much of the "
            "copy is the fresh allocation: glibc maps blocks over 32 MiB anew, so their pages "
            "fault in on first touch; a GPU's caching allocator reuses blocks.",
            "- This CPU has no grouped-GEMM kernel faster than its GEMM loop (PEERS.md); the "
            "point of the grouped path is fewer kernel launches and no host syncs on a GPU, "
            "measured by `benchmarks/gpu.py` when one is available."]
