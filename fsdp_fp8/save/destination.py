"""Where a save may write: checked before anything is loaded or written.

A save writes a new checkpoint: the target must be absent or an empty directory, and the
nearest existing directory above it must be one this process may create entries in.
``check_destination`` is what ``fsdp-fp8 save`` runs before it loads the source, so a bad
target is refused in a second instead of after a whole load; ``save_checkpoint`` checks it
again (the target may have changed meanwhile), and rank 0 checks that the whole checkpoint
fits in the filesystem's free space before it creates a file (``space_problem``: the files are
created as holes, so a full disk would otherwise show only in the middle of the writes).
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_fp8.collective import DEFAULT_TIMEOUT_S, distributed, exchange, merge_rank_problems, rank_and_world
from fsdp_fp8.errors import ExportError


def destination_problems(directory: Path) -> list[str]:
    """Why a save cannot write a new checkpoint at ``directory`` (empty: it can)."""
    directory = Path(directory)
    try:
        if directory.is_symlink():  # the rename into place would replace the link, not fill its target
            return [
                f"{directory} is a symbolic link (to {os.readlink(directory)}); save writes a new checkpoint "
                f"directory in its place: name the target itself ({directory.resolve()})"
            ]
        if directory.exists():
            if not directory.is_dir():
                return [f"{directory} exists and is not a directory; save writes a new checkpoint directory"]
            if any(directory.iterdir()):
                return [f"{directory} exists and is not an empty directory; save writes a new checkpoint"]
        above = directory.absolute().parent
        while not above.exists():
            above = above.parent
        if not above.is_dir():
            return [f"cannot create {directory}: {above} is not a directory"]
        if not os.access(above, os.W_OK | os.X_OK):
            return [f"cannot create {directory}: {above} is not writable by this user"]
    except OSError as exc:
        return [f"cannot check {directory}: {type(exc).__name__}: {exc}"]
    return []


def space_problem(directory: Path, needed: int) -> str | None:
    """Why ``needed`` bytes do not fit on the filesystem that will hold ``directory`` (None: they
    fit, or the filesystem does not say: some network filesystems report no size)."""
    above = Path(directory).absolute().parent
    while not above.exists():
        above = above.parent
    try:
        fs = os.statvfs(above)
    except OSError:
        return None
    free = fs.f_bavail * fs.f_frsize
    if fs.f_blocks == 0 or needed <= free:
        return None
    return (
        f"{directory} needs {needed:,} bytes but its filesystem ({above}) has {free:,} free for this "
        "user; nothing was written"
    )


def check_destination(directory: str | os.PathLike, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Raise ``ExportError`` if a save cannot write ``directory``; collective when a process
    group is up (every rank checks, and every rank raises the same error)."""
    directory = Path(directory)
    problems = destination_problems(directory)
    if distributed():
        rank, world = rank_and_world()
        verdicts = exchange(
            (rank, problems),
            timeout_s=timeout_s,
            stage="agreement on the destination",
            context=f"saving {directory}",
            before_changes=True,
        )
        found = [(rank, p) for rank, rank_problems in verdicts for p in rank_problems]
        problems = merge_rank_problems(found, world)
    if problems:
        raise ExportError(problems, f"cannot save {directory}")
