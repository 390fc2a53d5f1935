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


def _with_rank(text: str, rank: int) -> str:
    """``rank R: text`` unless the text already names the rank that failed (errors agreed
    over the checkpoint group carry the failing rank's name)."""
    return text if re.search(r"\brank \d+: ", text) else f"rank {rank}: {text}"


def _write_log(log_dir: Path, rank: int) -> str:
    """The current exception's traceback to ``log_dir/rank<r>.log``; a note for the line."""
    path = Path(log_dir) / f"rank{rank}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as log:
            log.write(traceback.format_exc())
    except OSError as err:
        return f"traceback not saved: {describe(err)}"
    return f"traceback: {path}"


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
        note = _write_log(Path(log_dir), rank)
        raise RankFailure(f"{_with_rank(describe(exc), rank)} ({note})") from None
    except Exception:
        _write_log(Path(log_dir), rank)
        raise
