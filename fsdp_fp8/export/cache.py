"""Build a directory once and keep it, safely when several processes ask for it at once.

torchrun ranks (the embedded demo) and benchmark runs ask for the same cached checkpoint
concurrently: an ``fcntl.flock`` on ``<target>.lock`` serialises them, the first builds into
a temporary sibling and renames it into place (atomic on one filesystem), the rest find it
finished. A crashed build leaves only a temporary directory, which the next caller removes;
a target that fails ``is_complete`` (damaged, half deleted) is rebuilt under the lock, where
nobody is reading it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_once(target: str | os.PathLike, build: Callable[[Path], None], is_complete: Callable[[Path], bool]) -> Path:
    """``target``, made by ``build(empty_temporary_directory)`` unless ``is_complete(target)``."""
    target = Path(target)
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not is_complete(target):
                for stale in root.glob(f".{target.name}.tmp-*"):  # from a crashed build
                    shutil.rmtree(stale, ignore_errors=True)
                tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
                try:
                    build(tmp)
                    if target.exists():
                        shutil.rmtree(target)
                    os.rename(tmp, target)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target
