"""The benchmark check: a new report against the committed one (not a timed test).

``python -m benchmarks.check OLD.md NEW.md`` (and ``benchmarks.run`` after it rewrites the main
tables): one line per failure and exit status 1 when a peer row of the main table is missing
or did not run ``ok``, or a moezero / peer peak-anon ratio of the ratios table grew by more
than ``TOLERANCE`` (10%) over the old report's. Ratios taken within one run, so the check
holds across machines and loads where absolute figures would not.
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.specs import PEER_CONFIGS

TOLERANCE = 0.10
"""How much a peak-anon ratio may grow over the committed report's before the check fails."""


def _table(text: str, heading: str) -> list[list[str]]:
    """The body rows (cells, stripped) of the first Markdown table under ``heading``."""
    if heading not in text:
        return []
    rows, started = [], False
    for line in text[text.index(heading):].splitlines()[1:]:
        if line.startswith("|"):
            started = True
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif started or line.startswith("#"):
            break
    return rows[2:]  # after the header and the --- row


def row_status(text: str) -> dict[str, str]:
    """Configuration -> status cell of the results table ('ok', 'failed: ...')."""
    return {row[0]: row[1] for row in _table(text, "## Results") if len(row) > 1}


def anon_ratios(text: str) -> dict[tuple[str, str], float]:
    """(moezero configuration, peer) -> peak-anon ratio of the ratios table."""
    out = {}
    for row in _table(text, "## Ratios"):
        if len(row) > 3 and row[3].endswith("×"):
            out[(row[0], row[1])] = float(row[3].removesuffix("×"))
    return out


def failures(old: str, new: str, tolerance: float = TOLERANCE) -> list[str]:
    """One line per failure of ``new`` against ``old`` (both report texts)."""
    status, out = row_status(new), []
    for peer, _, _ in PEER_CONFIGS:
        got = status.get(peer)
        if got != "ok":
            out.append(f"peer row {peer!r}: {got or 'missing from the results table'}")
    new_ratios = anon_ratios(new)
    for pair, before in anon_ratios(old).items():
        after = new_ratios.get(pair)
        if after is None:
            out.append(f"peak anon {pair[0]} / {pair[1]}: no ratio in the new report "
                       f"(was {before:.2f}×)")
        elif after > before * (1 + tolerance):
            out.append(f"peak anon {pair[0]} / {pair[1]}: {after:.2f}×, worse than the "
                       f"committed {before:.2f}× by more than {tolerance:.0%}")
    return out


def report_failures(old: str, new: str) -> int:
    """Print the failures (to stderr); 1 if any, else 0."""
    lines = failures(old, new)
    for line in lines:
        print(f"benchmark check: {line}", file=sys.stderr)
    if not lines:
        print("benchmark check: every peer row ran; no peak-anon ratio worsened by more than "
              f"{TOLERANCE:.0%}")
    return 1 if lines else 0


def main(argv: list[str] | None = None) -> int:
    old, new = argv if argv is not None else sys.argv[1:]
    return report_failures(Path(old).read_text(), Path(new).read_text())


if __name__ == "__main__":
    sys.exit(main())
