"""``python -m tests.support.hooked_cli [--save-delay S] [--enospc RANK:STEP] COMMAND ...``:
the ``moezero`` command with checkpoint save faults injected (``tests.support.faulty_save``:
a save writer passed in the I/O options, ``moezero.cli.main(argv, io=...)``), for tests that
need a real process to signal or kill. Test-only: the production CLI reads no faults from
anywhere.
"""

from __future__ import annotations

import argparse
import sys

from moezero.cli import main
from moezero.offload.options import IOOptions
from tests.support.faulty_save import faulty_io


def hooked(*, save_delay: float = 0.0, enospc: str | None = None) -> list[str]:
    """The command line head that runs the CLI with these faults (``sys.executable -m ...``)."""
    head = [sys.executable, "-m", "tests.support.hooked_cli", "--save-delay", str(save_delay)]
    return head + (["--enospc", enospc] if enospc else [])


def _faults(argv: list[str]) -> tuple[IOOptions, list[str]]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--save-delay", type=float, default=0.0)
    parser.add_argument("--enospc", metavar="RANK:STEP")
    args, rest = parser.parse_known_args(argv)
    enospc = tuple(map(int, args.enospc.split(":"))) if args.enospc else None
    return faulty_io(delay_s=args.save_delay, enospc=enospc), rest


if __name__ == "__main__":
    io, rest = _faults(sys.argv[1:])
    sys.exit(main(rest, io=io))
