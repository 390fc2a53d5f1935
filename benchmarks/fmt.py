"""Formatting shared by the report's sections: sizes, bandwidths, tables, target verdicts."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from benchmarks.specs import overrides

MiB = 2**20


def mib(n: float | None) -> str:
    return "–" if n is None else f"{n / MiB:,.0f} MiB"


def mbs(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e6:,.0f} MB/s"


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def verdict(value: float, need: float, kind: str) -> str:
    """'met' or 'missed by X%' for a ratio against its requirement (>=, <=, or <)."""
    if kind == ">=":
        return "met" if value >= need else f"missed by {100 * (1 - value / need):.0f}%"
    if kind == "<=":
        return "met" if value <= need else f"missed by {100 * (value / need - 1):.0f}%"
    return "met" if value < need else f"missed by {100 * (value / need - 1):.0f}% (needs < {need:g}×)"


def ok(stats: dict | None) -> bool:
    return bool(stats) and stats.get("status") == "ok"


def why_not(stats: dict | None) -> str:
    """A row's status when it has no figures: 'not run', 'not supported yet: ...'."""
    if not stats:
        return "not run"
    return f"{stats['status']}: {stats.get('reason', '')}"


def harness_command(results: dict, series: str | tuple[str, ...],
                    only: tuple[str, ...] = ()) -> str:
    """The command that reruns the series of one table (``only``: name filters)."""
    args = ["python", "-m", "benchmarks.run"] + (["--quick"] if results.get("mode") == "quick"
                                                 else [])
    series = (series,) if isinstance(series, str) else series
    args += [a for name in series for a in ("--series", name)]
    args += [a for text in only for a in ("--only", text)]
    return shlex.join(args)


def cli_command(spec: dict) -> str:
    """The moezero CLI line that trains the same configuration as a moezero run spec."""
    args = ["moezero", "train", "--nproc", str(spec.get("world_size", 2))]
    for item in overrides(spec):
        args += ["--set", item]
    return shlex.join(args)


def commands(results: dict, series: str | tuple[str, ...], spec: dict | None = None, vary: str = "",
             only: tuple[str, ...] = ()) -> list[str]:
    """Markdown lines with the harness command of a series and, for a moezero spec, the
    equivalent CLI line (``vary``: what the other rows change)."""
    lines = ["Command (this table only): `" + harness_command(results, series, only) + "`"]
    if spec is not None:
        lines += ["", f"Same configuration through the CLI{vary}:", "", "```",
                  cli_command(spec), "```"]
    return lines


def splice(text: str, section: list[str]) -> str:
    """``text`` with the ``## `` section headed like ``section[0]`` replaced by ``section``
    (inserted before the failures section, or appended, when absent)."""
    lines, head = text.rstrip("\n").split("\n"), section[0]
    starts = [i for i, ln in enumerate(lines) if ln.startswith("## ")]
    if head in lines:
        begin = lines.index(head)
        end = next((i for i in starts if i > begin), len(lines))
        lines[begin:end] = [*section, ""] if end < len(lines) else section
    else:
        at = next((i for i in starts if lines[i].startswith("## Not run")), len(lines))
        lines[at:at] = [*section, ""] if at < len(lines) else ["", *section]
    return "\n".join(lines) + "\n"


def write_section(out: Path, section: list[str], name: str, start: float) -> int:
    """Splice ``section`` into the report ``out`` (a new one when absent), print it and how
    long the series took since ``start``; 0, the harness's exit status."""
    out.write_text(splice(out.read_text() if out.exists() else "# Benchmarks\n", section))
    print("\n".join(section))
    print(f"updated the {name} section of {out} ({time.perf_counter() - start:.0f} s)")
    return 0
