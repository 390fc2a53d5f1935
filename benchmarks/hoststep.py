"""The ``hoststep`` series: the host AdamW against its peers and the memory-copy bound (issue 28).

One process, one thread, the same fp32 tensors (``benchmarks.hoststep_tensors.state``:
``size["hoststep"]["numel"]`` elements, 12 B of state each, >= 256 MB) for every row:
moezero's one-pass ``adamw_step_`` (compiled, and its torch-ops fallback), today's
``adamw_foreach_`` (ten ``_foreach_`` passes, the host step before issue 28),
``torch.optim.AdamW(fused=True)`` and ``(foreach=True)``, and ``DeepSpeedCPUAdam`` in the peer
venv (``benchmarks.hoststep_peer``). The bound is an in-place pass moving the same 28 B per
element (half read, half written back; a ``copy_`` is shown beside it). Then the whole offloaded ``optimizer_step()`` of the main
benchmark model (W = 1, ep 1, stage 2, ``offload_optimizer.device: cpu``, fp32) against the same
optimizer stepped the way it was before issue 28 (``legacy_step``). ``run_only`` measures and
rewrites this section of BENCHMARKS.md alone (``nox -s bench -- --series hoststep``; not in CI).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.adamw_foreach import adamw_foreach_
from benchmarks.fmt import table, verdict, write_section
from benchmarks.hoststep_tensors import BYTES_PER_ELEMENT, HYPER, best_ms, state
from benchmarks.machine import machine_info

SECTION = "## Host AdamW: one pass vs DeepSpeedCPUAdam, torch and the copy bound (issue 28)"
TARGETS = {"bound": 0.8, "deepspeed": 1.0, "step": 2.0}
ADAM = {k: HYPER[k] for k in ("beta1", "beta2", "eps")}
ONE_PASS = "moezero adamw_step_ (compiled, one pass)"
LEGACY = "moezero adamw_foreach_ (before issue 28)"
DEEPSPEED = "DeepSpeedCPUAdam (peer venv)"


def bound_ms(numel: int, repeats: int) -> dict[str, float]:
    """The bound: an in-place pass over 14 B per element (each line read, then written back:
    28 B per element moved, as AdamW moves them, whose written lines were all read)."""
    buf = torch.ones(numel * BYTES_PER_ELEMENT // 8)
    return best_ms(lambda: buf.mul_(1.0), repeats)


def copy_ms(numel: int, repeats: int) -> dict[str, float]:
    """A warm ``copy_`` of 14 B per element (28 B counted; the CPU also reads each destination
    line before writing it, 42 B of traffic), for comparison with the bound."""
    src = torch.ones(numel * BYTES_PER_ELEMENT // 8)
    dst = torch.zeros_like(src)  # touched: a first touch would halve the bandwidth
    return best_ms(lambda: dst.copy_(src), repeats)


def _moezero(compiled: bool):
    from moezero.zero.hostadam import adamw_step_

    def make(p, g, m, v):
        return lambda: adamw_step_(p, g, m, v, step=10, lr=HYPER["lr"], compiled=compiled,
                                   weight_decay=HYPER["weight_decay"], **ADAM)
    return make


def _foreach(p, g, m, v):
    return lambda: adamw_foreach_([p], [g], [m], [v], step=10, lr=HYPER["lr"],
                                  weight_decay=HYPER["weight_decay"], **ADAM)


def _torch_optim(kind: str):
    def make(p, g, m, v):
        param = torch.nn.Parameter(p)
        param.grad = g
        opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(ADAM["beta1"], ADAM["beta2"]),
                                eps=ADAM["eps"], weight_decay=HYPER["weight_decay"], **{kind: True})
        opt.step()  # creates the moments; then start from the series' values
        opt.state[param]["exp_avg"].copy_(m)
        opt.state[param]["exp_avg_sq"].copy_(v)
        return opt.step
    return make


ROWS = ((ONE_PASS, _moezero(True)), ("moezero adamw_step_ (torch-ops fallback)", _moezero(False)),
        ("torch.optim.AdamW(fused=True)", _torch_optim("fused")),
        ("torch.optim.AdamW(foreach=True)", _torch_optim("foreach")), (LEGACY, _foreach))


def _kernels(cfg: dict) -> dict[str, dict | str]:
    """ms per step of each in-process row (fresh tensors each: the same values)."""
    out: dict[str, dict | str] = {}
    for name, make in ROWS:
        try:
            out[name] = best_ms(make(*state(cfg["numel"])), cfg["repeats"])
        except Exception as e:  # one row's failure is reported, not fatal
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _deepspeed(cfg: dict, peer_python: str) -> dict | str:
    # the peer venv's bin first: DeepSpeed's JIT build of cpu_adam runs its ninja
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PATH": os.pathsep.join([str(Path(peer_python).parent), os.environ.get("PATH", "")])}
    try:
        done = subprocess.run([peer_python, "-m", "benchmarks.hoststep_peer", str(cfg["numel"]),
                               str(cfg["repeats"])], capture_output=True, text=True, env=env,
                              timeout=cfg["peer_timeout_s"], cwd=Path(__file__).parent.parent)
        line = (done.stdout.strip().splitlines() or [done.stderr.strip()[-300:] or "no output"])[-1]
        result = json.loads(line) if line.startswith("{") else {"error": line}
    except (OSError, subprocess.TimeoutExpired) as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    return result.get("ms", result.get("error", "?"))


def measure(size: dict, peer_python: str) -> dict:
    """Every row, the bound and the whole offloaded step, one thread (restored after)."""
    cfg, threads = size["hoststep"], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = _kernels(cfg)
        rows[DEEPSPEED] = _deepspeed(cfg, peer_python)
        result = {"config": cfg, "bound_ms": bound_ms(cfg["numel"], cfg["repeats"]),
                  "copy_ms": copy_ms(cfg["numel"], cfg["repeats"]),
                  "rows": rows, "optimizer_step": optimizer_step_ms(size)}
    finally:
        torch.set_num_threads(threads)
    return result


# ---------------------------------------------------------------------------- the whole step
def optimizer_step_ms(size: dict) -> dict:
    """The offloaded ``optimizer.step()`` of the main benchmark model, now and as before issue
    28, interleaved on one optimizer (the same state, the same gradients' shapes); best CPU
    time (the process's) of each."""
    from benchmarks.moezero_trainer import overrides
    from moezero.config import load_config
    from moezero.distributed.topology import build_topology
    from moezero.train import build_model
    from moezero.zero.build import build_optimizer
    from moezero.zero.groups import build_groups

    spec = {"model": {**size["model"], "ep_size": 1}, "train": size["train"],
            "options": {"zero_optimization.stage": 2,
                        "zero_optimization.offload_optimizer.device": "cpu"}}
    cfg = load_config(None, overrides(spec))
    topo = build_topology([1], num_experts=cfg.moe.num_experts)
    model = build_model(cfg, topo)
    opt = build_optimizer(dict(model.named_parameters()), build_groups(model, cfg, topo), topo,
                          cfg.zero_optimization, model=model)
    batch = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    opt.before_backward(final=True)
    model.loss(batch)[0].backward()
    opt.reduce_gradients()
    kw = {"lr": HYPER["lr"], "scale": 1.0, "max_norm": 1.0, "betas": (0.9, 0.95), "eps": 1e-8}
    now, before = [], []
    steps = ((now, lambda k: opt.step(step=k, tiled=True, **kw)),
             (before, lambda k: legacy_step(opt, step=k, **kw)))
    for k in range(1, size["hoststep"]["repeats"] + 2):
        for times, step in steps:
            start = time.process_time()
            step(k)
            times.append(1e3 * (time.process_time() - start))
    numel = sum(s.shard for s in opt.slots)
    opt.close()
    return {"numel": numel, "groups": len(opt.slots), "windows": len(opt.host_windows),
            "now_ms": min(now[1:]), "before_ms": min(before[1:])}


def legacy_step(opt, *, lr: float, scale: float, max_norm: float | None, step: int,
                betas: tuple[float, float], eps: float) -> None:
    """The offloaded step as it ran before issue 28 (git 3e3b580^: ``Optimizer._step_host``),
    kept as the benchmark's baseline (W = 1): the norm's terms from an fp32 copy of each
    gradient (the non-finite count left out), then per window an fp32 copy of each gradient,
    unscale and clip as two passes, ``adamw_foreach_`` per hyperparameter set, the downcast
    copy."""
    from moezero.zero.adamw import clip_coef

    sq = sum(float(s.grad.float().clone().square().sum(dtype=torch.float64)) for s in opt.slots)
    clip = clip_coef(math.sqrt(sq) / scale, max_norm)
    adam = {"step": step, "beta1": betas[0], "beta2": betas[1], "eps": eps}
    for window in opt.host_windows:
        grads = [s.grad.float().clone().mul_(1.0 / scale).mul_(clip) for s in window]
        sets: dict[tuple[float, float], list[list]] = {}
        for slot, g32 in zip(window, grads, strict=True):
            hp, n = slot.group.hparams, slot.master.numel()
            key = (lr * hp.get("lr_scale", 1.0), hp.get("weight_decay", 0.0))
            for into, t in zip(sets.setdefault(key, [[], [], [], []]),
                               (slot.master, g32[:n], slot.exp_avg[:n], slot.exp_avg_sq[:n]),
                               strict=True):
                into.append(t)
        for (group_lr, decay), tensors in sets.items():
            adamw_foreach_(*tensors, lr=group_lr, weight_decay=decay, **adam)
        for slot in window:
            opt._downcast(slot, slot.master)
    opt._after_step()


# ---------------------------------------------------------------------------- report
def section(results: dict) -> list[str]:
    """The BENCHMARKS.md section of ``results["hoststep"]``."""
    data = results.get("hoststep")
    if not data:
        return [SECTION, "", "Not run (`nox -s bench -- --series hoststep`)."]
    cfg, bound, rows = data["config"], data["bound_ms"]["cpu"], data["rows"]
    ds = _cpu(rows.get(DEEPSPEED))
    body = []
    for name, ms in rows.items():
        if not isinstance(ms, dict):
            body.append([name, f"failed: {ms}", "–", "–", "–"])
            continue
        vs_ds = f"{ds / ms['cpu']:.2f}×" if ds else "–"
        body.append([name, f"{ms['cpu']:.1f}", f"{ms['wall']:.1f}",
                     f"{100 * bound / ms['cpu']:.0f}%", vs_ds])
    step = data["optimizer_step"]
    return [SECTION, "",
            f"One thread, {cfg['numel']:,} fp32 elements ({12 * cfg['numel'] / 2**20:,.0f} MiB "
            f"of master + moments, {BYTES_PER_ELEMENT} B per element to move), the same "
            f"tensors for every row; best of {cfg['repeats']} steps after a warm-up, in CPU time "
            "(the process's: time spent descheduled by other load left out; ratios use it) and "
            f"wall time. Bound: an in-place pass (`mul_(1.0)`) over 14 B per element, each line "
            f"read and written back as AdamW's are, the same 28 B moved: {bound:.1f} ms CPU "
            f"({data['bound_ms']['wall']:.1f} ms wall). A warm `copy_` of those bytes takes "
            f"{data['copy_ms']['cpu']:.1f} ms CPU: the CPU reads every destination line before "
            "writing it (write-allocate), 42 B of traffic for 28 B counted, so a copy bound "
            "flatters every row by about 1.5×. Run: "
            f"`{results.get('command', '')}` ({results['machine']['date']}; load average "
            f"{results.get('load', '?')}).", "",
            *table(["AdamW", "CPU ms per step", "wall ms", "bound / CPU ms",
                    "speed vs DeepSpeedCPUAdam (CPU time)"], body), "",
            f"Whole offloaded `optimizer.step()` of the main benchmark model (W = 1, ep 1, "
            f"stage 2, optimizer on the CPU, fp32; {step['numel']:,} elements in "
            f"{step['groups']} groups, {step['windows']} window(s)): {step['now_ms']:.1f} ms "
            "CPU time, "
            f"against {step['before_ms']:.1f} ms stepped as before issue 28 (`legacy_step`: "
            "fp32 gradient copies, unscale and clip as two passes, `adamw_foreach_`, the "
            "downcast copy), interleaved on the same optimizer.", "",
            *table(["target", "measured", "verdict"], _targets(data)), "",
            "- The one-pass kernel (`moezero/zero/csrc/adamw_host.cpp`) reads each element's "
            "gradient (any compute dtype), master and moments once and writes them once, "
            "applies unscale × clip and writes the bf16/fp16 param in the same pass; "
            "`torch._fused_adamw_` (the fused row) cannot take a bf16 gradient or write the "
            "downcast, and rounds its vector body and scalar tail differently, so a tier's "
            "slicing would change its results (`moezero.zero.hostadam`).",
            "- One thread streams four arrays; the kernel asks for each array's lines 2 KiB "
            "ahead of the 64-element chunk it updates (`__builtin_prefetch`; the results are "
            "unchanged). Without it the same loop ran at 0.96× DeepSpeedCPUAdam (40.5 against "
            "38.9 ms, 2026-11-26 01:13 UTC); with it 1.06×, 1.03× and 1.06× in three runs at "
            "02:43-02:50 UTC. "
            "What did not help on this memory-bound loop: 512-bit vectors "
            "(`-mprefer-vector-width=512`), `-funroll-loops`, fused multiply-adds, streaming "
            "stores (slower: 43.5 against 36.3 ms)."]


def _cpu(ms) -> float | None:
    return ms["cpu"] if isinstance(ms, dict) else None


def _targets(data: dict) -> list[list[str]]:
    rows, bound = data["rows"], data["bound_ms"]["cpu"]
    mine, ds = _cpu(rows.get(ONE_PASS)), _cpu(rows.get(DEEPSPEED))
    step = data["optimizer_step"]
    out = []
    if mine:
        out.append([f"one pass ≥ {100 * TARGETS['bound']:.0f}% of the copy bound",
                    f"{100 * bound / mine:.0f}%", verdict(bound / mine, TARGETS["bound"], ">=")])
        out.append([f"one pass ≥ {TARGETS['deepspeed']:.1f}× DeepSpeedCPUAdam's speed",
                    f"{ds / mine:.2f}×" if ds else f"not measured: {rows.get(DEEPSPEED)}",
                    verdict(ds / mine, TARGETS["deepspeed"], ">=") if ds else "not measured"])
    speedup = step["before_ms"] / step["now_ms"]
    out.append([f"whole offloaded step ≥ {TARGETS['step']:.0f}× faster than before",
                f"{speedup:.2f}×", verdict(speedup, TARGETS["step"], ">=")])
    return out


def run_only(args, out: Path, work: Path, size: dict) -> int:
    """``--series hoststep``: measure, keep the JSON, rewrite only this section."""
    start = time.perf_counter()
    results = {"machine": machine_info(), "command": "python -m benchmarks.run "
               + " ".join(sys.argv[1:]), "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
               "hoststep": measure(size, args.peer_python)}
    (work / "results-hoststep.json").write_text(json.dumps(results, indent=1))
    return write_section(out, section(results), "hoststep", start)
