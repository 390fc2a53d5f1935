"""The ``hoststep`` series' DeepSpeed row: ``DeepSpeedCPUAdam`` on the series' tensors.

Runs in the peer venv (``python -m benchmarks.hoststep_peer NUMEL REPEATS``) with one OpenMP
thread; DeepSpeed builds its ``cpu_adam`` op at first use (JIT, into torch's extension cache)
when the install did not. Prints one JSON line: ``{"ms": {"cpu": ms, "wall": ms}}`` (best step)
or ``{"error": line}``.
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks.hoststep_tensors import HYPER, best_ms, state


def main() -> None:
    numel, repeats = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        p, g, m, v = state(numel)
        param = torch.nn.Parameter(p)
        param.grad = g
        opt = DeepSpeedCPUAdam([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                               eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                               adamw_mode=True, fp32_optimizer_states=True)
        opt.step()  # creates the moments; then start from the series' values
        opt.state[param]["exp_avg"].copy_(m)
        opt.state[param]["exp_avg_sq"].copy_(v)
        del m, v
        print(json.dumps({"ms": best_ms(opt.step, repeats)}))
    except Exception as e:  # one line for the report, whatever failed
        print(json.dumps({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}))


if __name__ == "__main__":
    main()
