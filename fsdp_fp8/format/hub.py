"""Hugging Face hub names resolved through the local cache only, never the network.

    org/name             -> <hub cache>/models--org--name/snapshots/<commit of refs/main>
    org/name@revision    -> the snapshot of that branch, tag or commit
    .../models--org--name[@revision]   (a cache repo root) -> its snapshot, the same way

An existing directory is always taken as it is: ``org/name`` names a repo only when no such
directory exists. The lookup is ``huggingface_hub.snapshot_download(..., local_files_only=True)``,
which reads ``refs/`` and ``snapshots/`` and makes no request; a snapshot that is not in the
cache is an error saying so. ``huggingface_hub`` comes with ``fsdp_fp8[hf]`` and is imported
only when a hub name is given.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What the hub accepts as an owner and a repo name ("--" and ".." are refused there too).
REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96})(?:@(?P<revision>[\w./-]+))?$")
_ROOT_PREFIX = "models--"


def _split_revision(path: Path) -> tuple[Path, str | None]:
    """``.../models--org--name@rev`` -> (``.../models--org--name``, ``rev``)."""
    name, at, revision = path.name.partition("@")
    if at and name.startswith(_ROOT_PREFIX) and revision:
        return path.with_name(name), revision
    return path, None


def is_repo_root(directory: Path) -> bool:
    return directory.name.startswith(_ROOT_PREFIX) and (directory / "snapshots").is_dir()


def resolve_hub_path(path: str | os.PathLike) -> Path:
    """The local directory ``path`` names: itself, or the cached snapshot of a hub name."""
    text = os.fspath(path)
    candidate = Path(text)
    root, revision = _split_revision(candidate)
    if is_repo_root(root) and (root == candidate or not candidate.exists()):
        repo = root.name[len(_ROOT_PREFIX) :].replace("--", "/", 1)
        return _snapshot(repo, revision, str(root.parent), f"hub cache repo {root}")
    if candidate.exists():
        return candidate
    match = REPO_ID.match(text)
    if match is None:
        return candidate  # neither a directory nor a repo id: the caller reports it missing
    return _snapshot(match["repo"], match["revision"], None, f"{text!r} (no such directory; as a hub repo id)")


def _snapshot(repo: str, revision: str | None, cache_dir: str | None, what: str) -> Path:
    try:
        import huggingface_hub.constants
    except ImportError:
        raise FileNotFoundError(
            f"{what}: resolving a Hugging Face hub name needs huggingface_hub "
            "(pip install 'fsdp_fp8[hf]'), or pass the snapshot directory itself"
        ) from None
    cache = cache_dir or huggingface_hub.constants.HF_HUB_CACHE
    wanted = f"{repo}@{revision}" if revision else repo
    try:
        folder = huggingface_hub.snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True)
    except Exception as exc:  # LocalEntryNotFoundError, IncompleteSnapshotError, HFValidationError
        raise FileNotFoundError(
            f"{what}: no complete snapshot of {wanted} in the local Hugging Face cache {cache} "
            f"({type(exc).__name__}: {exc}); fsdp_fp8 never downloads: fetch it first "
            f"(e.g. `hf download {repo}{f' --revision {revision}' if revision else ''}`) or set HF_HUB_CACHE"
        ) from None
    return Path(folder)
