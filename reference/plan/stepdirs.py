"""The life cycle of step directories: crash-safe commit, ``latest``, retention, lookup.

A save is written under ``step_XXXXXXXX.partial/`` (``begin_save``); ``commit`` checks it,
flushes it and renames it, then replaces ``latest`` atomically. A directory without a
complete manifest is never loaded (``find_latest``, ``find_checkpoint``); ``apply_retention``
deletes old checkpoints manifest first, so a crash mid-delete leaves an incomplete one, never
a wrong one. Torch counterpart: ``moezero.checkpoint.core`` (drives a save to ``commit``).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Collection
from pathlib import Path

from moezero.plan.files import CheckpointError, check_file, fsync_dir, fsync_file
from moezero.plan.layout import MANIFEST_NAME, Layout
from moezero.plan.reading import read_manifest

PARTIAL, STALE = ".partial", ".stale"
_STEP_DIR = re.compile(r"step_(\d{8,})(\.partial|\.stale)?")


def step_dir_name(step: int) -> str:
    """``step_00000050`` for step 50."""
    return f"step_{step:08d}"


def begin_save(root: str | os.PathLike, step: int) -> Path:
    """Create an empty ``root/step_XXXXXXXX.partial/`` (rank 0), removing a stale one."""
    partial = Path(root) / (step_dir_name(step) + PARTIAL)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def commit(partial_dir: str | os.PathLike, *, flushed: bool = False,
           layout: Layout | None = None) -> Path:
    """Publish a finished save: fsync files and dir, rename, then replace ``latest``.

    Refuses (CheckpointError) a directory whose manifest is missing or names a missing or
    truncated file. An existing checkpoint of the same step is replaced. ``flushed``: the
    caller already fsynced every file after its last write (each writer its own ranges, the
    header writer every file; the JSON files are always fsynced), so only the directories are.
    ``layout``: the layout whose manifest the caller has just written (``write_manifest``
    checked it), so the manifest is not parsed again; the files are still checked.

    Returns:
        The committed ``step_XXXXXXXX`` directory.
    """
    partial = Path(partial_dir)
    if not partial.name.endswith(PARTIAL):
        raise ValueError(f"{partial}: not a {PARTIAL} directory")
    if layout is None:
        read_manifest(partial)
    elif not (partial / MANIFEST_NAME).is_file():
        raise CheckpointError(f"{partial}: no {MANIFEST_NAME} (incomplete checkpoint)")
    else:
        for f in layout.files:
            check_file(partial / f.name, f.size)
    for path in () if flushed else partial.iterdir():
        fsync_file(path)
    fsync_dir(partial)
    final, root = partial.with_name(partial.name[:-len(PARTIAL)]), partial.parent
    stale = root / (final.name + STALE)
    if final.exists():
        shutil.rmtree(stale, ignore_errors=True)
        (final / MANIFEST_NAME).unlink(missing_ok=True)  # incomplete before anything moves
        final.rename(stale)
    partial.rename(final)
    fsync_dir(root)
    _write_latest(root, final.name)
    shutil.rmtree(stale, ignore_errors=True)
    return final


def _write_latest(root: Path, name: str) -> None:
    """Point ``latest`` at ``name`` (committed already) through ``latest.tmp``. A failure
    (a full disk) removes ``latest.tmp`` and is one CheckpointError naming ``latest`` and
    the committed step; ``latest`` then still names the previous checkpoint."""
    tmp = root / "latest.tmp"
    try:
        tmp.write_text(name)
        fsync_file(tmp)
        os.replace(tmp, root / "latest")
        fsync_dir(root)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{root / 'latest'}: {exc.strerror or exc} ({name} is committed; "
                              "latest still names the checkpoint before it)") from None


def find_latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from: ``latest`` if it names a complete one, else the newest
    complete ``step_XXXXXXXX`` (valid manifest, every file present at its size).

    ``.partial`` directories and directories without a manifest are never returned.
    """
    root = Path(root)
    named = _latest_target(root)
    if named is not None and _is_complete(named):
        return named
    return next((p for p in _step_dirs(root) if _is_complete(p)), None)


def apply_retention(root: str | os.PathLike, keep_last: int, *,
                    committed: Path | None = None,
                    owned: Collection[Path] | None = None) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last`` (never ``latest``'s target),
    and ``.partial``/``.stale`` directories older than the newest complete one.

    ``committed``: a step directory the caller has just committed, known complete (its
    manifest is not read again). ``owned``: when given, the only complete checkpoints that
    count and may be deleted (a run deletes only the steps it wrote or resumed from; another
    run's are left alone).

    Returns:
        The directories removed.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(root)
    complete = [p for p in _step_dirs(root) if p == committed or _is_complete(p)]
    if owned is not None:
        mine = {Path(p).resolve() for p in owned}
        complete = [p for p in complete if p.resolve() in mine]
    keep = set(complete[:keep_last]) | {_latest_target(root)}
    doomed = [p for p in complete if p not in keep]
    if complete:
        newest = _step_of(complete[0])
        doomed += [p for p in _step_dirs(root, suffixes=(PARTIAL, STALE)) if _step_of(p) < newest]
    for path in doomed:
        (path / MANIFEST_NAME).unlink(missing_ok=True)  # incomplete first, in case of a crash
        shutil.rmtree(path)
    return doomed


def complete_steps(root: str | os.PathLike) -> list[Path]:
    """The complete step directories of ``root``, newest first."""
    return [p for p in _step_dirs(Path(root)) if _is_complete(p)]


def _latest_target(root: Path) -> Path | None:
    try:
        name = (root / "latest").read_text().strip()
    except OSError:
        return None
    match = _STEP_DIR.fullmatch(name)
    return root / name if match and not match.group(2) else None


def _step_dirs(root: Path, suffixes: tuple[str | None, ...] = (None,)) -> list[Path]:
    """Step directories with one of ``suffixes`` (``None``: committed), newest first."""
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _STEP_DIR.fullmatch(path.name)
        if match and match.group(2) in suffixes and path.is_dir() and not path.is_symlink():
            found.append(path)
    return sorted(found, key=_step_of, reverse=True)


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.fullmatch(path.name).group(1))


def _is_complete(path: Path) -> bool:
    try:
        return read_manifest(path).step == _step_of(path)
    except CheckpointError:
        return False


def find_checkpoint(path: str | os.PathLike) -> Path:
    """A step directory as given, or a checkpoint root's ``latest`` (newest complete one).

    Raises:
        CheckpointError: (one line) no such directory, or a root with no complete checkpoint.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    named = _STEP_DIR.fullmatch(path.name)
    if named and named.group(2):
        raise CheckpointError(f"{path}: an unfinished save ({named.group(2)}), never loaded")
    if named or (path / MANIFEST_NAME).exists():
        return path
    found = find_latest(path)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint (no step directory with a "
                              "valid manifest)")
    return found
