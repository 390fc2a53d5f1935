"""Expected failures of a rank as one line; the traceback goes to a log in the run directory.

A disk that fills up, a path that is missing or not writable, a damaged checkpoint or a bad
value found once the ranks run are not bugs: the user needs the rank, the path and the cause,
not a Python traceback from every rank. ``rank_errors`` turns the exceptions its caller
expects into ``RankFailure`` (one line, naming the rank and the log file) after writing the
traceback to ``<run dir>/logs/rank<r>.log``; anything else is logged and re-raised as it is.
The launcher prints a ``RankFailure`` as ``moezero: error: ...`` and exits with
``FAILED_EXIT`` (docs/reliability.md).
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moezero.distributed.signals import Preempted

__all__ = ["FAILED_EXIT", "RankFailure", "describe", "rank_errors"]

FAILED_EXIT = 2
"""Exit code of a run ended by an expected error (one line; also bad input before start)."""


class RankFailure(Exception):
    """An expected error of a rank, already one line: ``rank R: <path>: <cause> (traceback:
    <log>)``."""


def describe(exc: BaseException) -> str:
    """One line for an exception: ``<path>: <cause>`` for an OS error that names its file,
    else its message with the whitespace collapsed."""
    if isinstance(exc, OSError) and exc.filename is not None:
        text = f"{exc.filename}: {exc.strerror or exc}"
        return text if exc.filename2 is None else f"{text} (-> {exc.filename2})"
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _with_rank(text: str, rank: int) -> tuple[str, int]:
    """``rank R: text`` unless the text already names the rank that failed (errors agreed
    over the checkpoint group carry the failing rank's name), and that rank."""
    named = re.search(r"\brank (\d+): ", text)
    return (text, int(named.group(1))) if named else (f"rank {rank}: {text}", rank)


def _log_path(log_dir: Path, rank: int) -> Path:
    return Path(log_dir) / f"rank{rank}.log"


def _write_log(log_dir: Path, rank: int) -> str | None:
    """The current exception's traceback to ``log_dir/rank<r>.log``; a note when it failed."""
    path = _log_path(log_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as log:
            log.write(traceback.format_exc())
    except OSError as err:
        return f"traceback not saved: {describe(err)}"
    return None


@contextmanager
def rank_errors(rank: int, log_dir: str | Path,
                expected: tuple[type[BaseException], ...]) -> Iterator[None]:
    """Run the body; an ``expected`` exception becomes ``RankFailure`` (one line), any other
    exception is logged and re-raised. ``Preempted``, ``KeyboardInterrupt`` and ``SystemExit``
    pass."""
    try:
        yield
    except Preempted:
        raise
    except expected as exc:
        failed = _write_log(Path(log_dir), rank)
        text, named = _with_rank(describe(exc), rank)  # the line points to the named rank's log
        note = failed or f"traceback: {_log_path(Path(log_dir), named)}"
        raise RankFailure(f"{text} ({note})") from None
    except Exception:
        _write_log(Path(log_dir), rank)
        raise
