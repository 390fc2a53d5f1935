"""The gated delta rule's tokens/s: moezero's chunked form (``moezero.model.gated_delta``)
against transformers' ``torch_chunk_gated_delta_rule`` (Qwen3-Next's torch path, issue 37),
forward and forward + backward, on the same CPU, inputs, lengths, dtype and chunk size.

``python -m benchmarks.gated_delta [--quick] [--out BENCHMARKS.md] [--repeats N]`` (outside
CI). Both sides take the same raw tensors as Qwen3-Next's layer hands them over: q, k, v
``[B, S, H, K|V]`` (q and k not yet L2-normalised), the log decay g and beta ``[B, S, H]``;
each normalises, scales and lays out q/k itself and returns o ``[B, S, H, V]``. moezero also
runs with document starts (a packed row of ``DOCS`` documents: the state restarts at each),
which transformers' torch path has no counterpart for. Each measurement is one warm-up then
``repeats`` timed calls per side, interleaved (moezero, transformers, moezero, ...), on one
thread; the section reports the medians, and the largest output and gradient difference
between the two sides (the same computation). Rewrites only its section of ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.fmt import table, write_section
from benchmarks.machine import machine_info

SECTION = ("## Gated delta rule: moezero's chunked form vs transformers' "
           "`torch_chunk_gated_delta_rule` (issue 37)")
SIZES = {"full": {"batch": 1, "heads": 8, "head_dim": 128, "lengths": (512, 2048),
                  "repeats": 5},
         "quick": {"batch": 1, "heads": 4, "head_dim": 64, "lengths": (256,), "repeats": 2}}
CHUNK = 64
DOCS = 4


def inputs(size: dict, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 q, k, v, g (log decay < 0) and beta of one row of ``seq`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d = size["batch"], size["heads"], size["head_dim"]

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    return {"q": rand(b, seq, h, d), "k": rand(b, seq, h, d), "v": rand(b, seq, h, d),
            "g": F.logsigmoid(rand(b, seq, h) + 3.0), "beta": torch.sigmoid(rand(b, seq, h))}


def moezero_rule(q, k, v, g, beta, starts_BS=None):
    """moezero's path from Qwen3-Next's raw tensors: L2 norm and scale q/k, heads first, the
    chunked rule, sequence first again."""
    from moezero.model.gated_delta import gated_delta_rule, l2norm

    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    o = gated_delta_rule(*(x.transpose(1, 2) for x in (q, k, v, g, beta)), starts_BS, CHUNK)
    return o.transpose(1, 2)


def hf_rule(q, k, v, g, beta):
    """transformers' torch path as Qwen3-Next's layer calls it (L2 norm in the kernel)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=CHUNK,
                                        use_qk_l2norm_in_kernel=True)[0]


def doc_starts(batch: int, seq: int) -> torch.Tensor:
    """[B, S] True at the starts of ``DOCS`` equal documents of the row."""
    starts = torch.zeros(batch, seq, dtype=torch.bool)
    starts[:, ::max(1, seq // DOCS)] = True
    return starts


def _call(fn, data: dict, backward: bool):
    """One call of ``fn`` on fresh leaves of ``data``: (o, the inputs' gradients or None)."""
    leaves = {k: v.detach().requires_grad_(backward) for k, v in data.items()}
    if not backward:
        with torch.no_grad():
            return fn(**leaves), None
    out = fn(**leaves)
    out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def _timed(fn, data: dict, backward: bool) -> float:
    start = time.perf_counter()
    _call(fn, data, backward)
    return time.perf_counter() - start


def measure_length(size: dict, seq: int, repeats: int) -> dict:
    """Medians of each side's forward and forward + backward seconds at ``seq`` tokens, and
    the largest differences between the two sides' outputs and gradients."""
    data = inputs(size, seq)
    starts = doc_starts(size["batch"], seq)
    sides = {"moezero": moezero_rule, "transformers": hf_rule,
             "moezero, with document starts": lambda **x: moezero_rule(**x, starts_BS=starts)}
    out: dict = {"seq": seq, "tokens": size["batch"] * seq}
    for backward in (False, True):
        times: dict[str, list[float]] = {name: [] for name in sides}
        for fn in sides.values():
            _timed(fn, data, backward)  # warm-up
        for _ in range(repeats):
            for name, fn in sides.items():
                times[name].append(_timed(fn, data, backward))
        out["fwd_bwd" if backward else "fwd"] = times
    (o_m, g_m), (o_h, g_h) = (_call(f, data, True) for f in (moezero_rule, hf_rule))
    out["max_abs_out"] = float((o_m - o_h).abs().max())
    out["max_abs_grad"] = max(float((g_m[k] - g_h[k]).abs().max()) for k in g_m)
    return out


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def measure(size: dict, repeats: int) -> dict:
    """Every length of ``size`` on one thread, with the machine's load around it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before = _uptime()
        rows = [measure_length(size, seq, repeats) for seq in size["lengths"]]
        return {"size": size, "repeats": repeats, "rows": rows, "uptime_before": before,
                "uptime_after": _uptime()}
    finally:
        torch.set_num_threads(threads)


def _rate(tokens: int, times: list[float]) -> str:
    each = " / ".join(f"{tokens / t:,.0f}" for t in times)
    return f"{tokens / statistics.median(times):,.0f} ({each})"


def result_rows(res: dict) -> list[list[str]]:
    """One table row per length and pass: each side's median tokens/s (each repeat's) and
    moezero's ratio to transformers."""
    out = []
    for row in res["rows"]:
        for key, label in (("fwd", "forward"), ("fwd_bwd", "forward + backward")):
            t = row[key]
            ratio = statistics.median(t["transformers"]) / statistics.median(t["moezero"])
            out.append([f"{row['seq']:,}", label, _rate(row["tokens"], t["moezero"]),
                        _rate(row["tokens"], t["transformers"]), f"{ratio:.2f}×",
                        _rate(row["tokens"], t["moezero, with document starts"])])
    return out


def section(res: dict, command: str, date: str) -> list[str]:
    size = res["size"]
    diffs = ", ".join(f"{r['seq']:,}: output {r['max_abs_out']:.1e}, gradients "
                      f"{r['max_abs_grad']:.1e}" for r in res["rows"])
    return [SECTION, "",
            f"One row (batch {size['batch']}) of {size['heads']} heads, key and value head dim "
            f"{size['head_dim']}, fp32, chunk {CHUNK}, one thread; random q, k, v, "
            "g = logsigmoid(N(3, 1)) and beta = sigmoid(N(0, 1)) handed over as Qwen3-Next's "
            "layer does ([B, S, H, D], q and k not yet L2-normalised). One warm-up, then "
            f"{res['repeats']} timed calls per side, interleaved; the median tokens/s (each "
            "call's in brackets). Forward under `torch.no_grad`; forward + backward takes the "
            "gradients of q, k, v, g and beta. Largest |moezero − transformers| at S = "
            f"{diffs}.", "",
            *table(["S", "pass", "moezero tokens/s", "transformers tokens/s",
                    "moezero / transformers", f"moezero, {DOCS} documents per row"],
                   result_rows(res)), "",
            f"Run: `{command}` ({date}; `uptime` before: {res['uptime_before']}; after: "
            f"{res['uptime_after']}).", "",
            "- The document-starts column is moezero's rule as packed training runs it "
            "(`data.document_mask`: the state restarts at each document); transformers' torch "
            "path has no such input (packed rows need its CUDA-only `fla` kernel: it refuses "
            "`cu_seqlens` without it)."]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gated_delta",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one short length, 2 repeats")
    p.add_argument("--out", default="BENCHMARKS.md", help="report whose section to rewrite")
    p.add_argument("--repeats", type=int, help="timed calls per side (default 5; quick 2)")
    args = p.parse_args(argv)
    size = SIZES["quick" if args.quick else "full"]
    start = time.perf_counter()
    res = measure(size, args.repeats or size["repeats"])
    command = "python -m benchmarks.gated_delta " + " ".join(sys.argv[1:] if argv is None
                                                             else argv)
    return write_section(Path(args.out), section(res, command.strip(),
                                                 machine_info()["date"]), "gated-delta", start)


if __name__ == "__main__":
    sys.exit(main())
