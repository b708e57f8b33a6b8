"""The files of a source checkpoint that are not weights, carried into the saved one.

A save writes the weights, their index, ``config.json`` and ``hf_quant_config.json`` anew; every
other regular file of the source directory (``generation_config.json``, tokenizer files, a model
card, ...) is copied as it is, so the new checkpoint runs like the old one. What is not carried
is named, with why: sub-directories, pickle weights (never read), anything that is not a regular
file, and symlinks leading out of the directory (a hostile checkpoint could otherwise have a
save copy, say, the user's keys into a new, readable checkpoint; links into the Hugging Face
cache's own ``blobs/`` are followed, as the reader follows them). A diffusers pipeline's other
components (its ``vae/``, ``scheduler/``, ...) are not carried either: the save holds the
transformer only.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from fsdp_fp8.format.files import PICKLE_SUFFIXES, hub_blobs
from fsdp_fp8.format.handles import open_regular
from fsdp_fp8.format.pipeline_config import has_pipeline_index

REWRITTEN = ("config.json", "hf_quant_config.json")  # written anew by the save
_COPY_BLOCK = 1 << 24


@dataclass(frozen=True)
class SourceFiles:
    """The non-weight files of ``directory`` a save copies, and those it does not (name, why)."""

    directory: Path | None
    carried: tuple[str, ...] = ()
    not_carried: tuple[tuple[str, str], ...] = ()

    def bytes(self) -> int:
        """What the carried files take."""
        return sum((self.directory / name).stat().st_size for name in self.carried)

    def lines(self) -> list[str]:
        return [f"not carried from {self.directory}: {name} ({why})" for name, why in self.not_carried]


def _is_weights(name: str) -> bool:
    return name.endswith((".safetensors", ".safetensors.index.json")) or name in REWRITTEN


def _refusal(path: Path, directory: Path) -> str | None:
    """Why ``path`` is not carried, or None to carry it."""
    if path.name.endswith(PICKLE_SUFFIXES) or path.name.endswith(".bin.index.json"):
        return "pickle weights, never read"
    try:
        if path.is_symlink() and path.resolve().parent not in (directory.resolve(), hub_blobs(directory)):
            return f"a symlink to {path.resolve()}, outside the checkpoint"
        mode = path.stat().st_mode
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Path.resolve, 3.11)
        return f"cannot be looked up: {type(exc).__name__}: {exc}"
    if stat.S_ISDIR(mode):
        return "a directory"
    if not stat.S_ISREG(mode):
        return "not a regular file"
    return None


def source_files(directory: Path | None) -> SourceFiles:
    """What a save of a checkpoint at ``directory`` (None: no source) carries and does not."""
    if directory is None:
        return SourceFiles(None)
    carried, not_carried = [], []
    for path in sorted(directory.iterdir()):
        if _is_weights(path.name):
            continue
        why = _refusal(path, directory)
        if why is None:
            carried.append(path.name)
        else:
            not_carried.append((path.name, why))
    if directory.name == "transformer" and has_pipeline_index(directory.parent):
        not_carried.append(
            ("../", f"the rest of the diffusers pipeline in {directory.parent}: the save holds its transformer")
        )
    return SourceFiles(directory, tuple(carried), tuple(not_carried))


def copy_source_files(files: SourceFiles, into: Path) -> None:
    """Copy every carried file into ``into`` (new files: the user's umask applies), synced."""
    for name in files.carried:
        problems: list[str] = []
        handle = open_regular(files.directory / name, name, problems)  # never blocks on a pipe
        if handle is None:
            raise OSError(f"cannot copy {files.directory / name}: {problems[0]}")
        try:
            fd = os.open(into / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                offset = 0
                while block := handle.pread(_COPY_BLOCK, offset):
                    view = memoryview(block)
                    while view:
                        view = view[os.write(fd, view) :]
                    offset += len(block)
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            handle.close()
