"""Hugging Face hub names resolved through the local cache only, never the network.

:func:`resolve_hub_path` maps ``org/name[@revision]``, or a cache repo root
``.../models--org--name[@revision]``, to its snapshot directory. An existing directory is always
taken as it is. The lookup is ``snapshot_download(..., local_files_only=True)``, which makes no
request; a snapshot not in the cache is an error saying so. ``huggingface_hub`` is imported only
when a hub name is given.

A name never leads out of the cache: the revision, the ref file's text and the resolved snapshot
are checked here (huggingface_hub checks none of them), and anything else is refused.

Usage: docs/usage.md, "Inspecting and verifying a checkpoint" ("Hub names"); docs/reliability.md, "Refused".
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from fsdp_fp8.errors import CheckpointPathError

# What the hub accepts as an owner and a repo name ("--" and ".." are refused below, as there).
REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96})(?:@(?P<revision>.*))?$")
COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")
_ROOT_PREFIX = "models--"
# git check-ref-format: no control characters, space, ~ ^ : ? * [ or backslash anywhere.
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")


def ref_name_problem(revision: str) -> str | None:
    """Why ``revision`` is no valid git ref name (git's ``check-ref-format``), or None."""
    if not revision:
        return "it is empty"
    if revision == "@":
        return "it is `@`"
    if match := _REF_FORBIDDEN.search(revision):
        return f"it holds {match.group()!r}"
    if ".." in revision:
        return "it holds `..`"
    if "@{" in revision:
        return "it holds `@{`"
    if revision.startswith("/") or revision.endswith("/") or "//" in revision:
        return "it starts or ends with `/` or holds `//`"
    if revision.endswith("."):
        return "it ends with `.`"
    for component in revision.split("/"):
        if component.startswith("."):
            return f"its component {component!r} starts with `.`"
        if component.endswith(".lock"):
            return f"its component {component!r} ends with `.lock`"
    return None


class HubNameRefused(CheckpointPathError):
    """A hub name whose revision, ref or snapshot would lead outside the cache."""


def _split_revision(path: Path) -> tuple[Path, str | None]:
    """``.../models--org--name@rev`` -> (``.../models--org--name``, ``rev``)."""
    name, at, revision = path.name.partition("@")
    if at and name.startswith(_ROOT_PREFIX):
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
        return _snapshot(repo, revision, str(root.parent), text, f"hub cache repo {root}:")
    if candidate.exists():
        return candidate
    match = REPO_ID.match(text)
    if match is None:
        return candidate  # neither a directory nor a repo id: the caller reports it missing
    where = "" if candidate.is_absolute() else f" (relative to {os.getcwd()})"
    return _snapshot(match["repo"], match["revision"], None, text, f"{text!r}: no such directory{where}, and")


def checkpoint_identity(path: str | os.PathLike) -> str:
    """What ranks compare to know they load one checkpoint: a hub snapshot's repository folder and
    commit (``models--org--name/snapshots/<commit>``, wherever each node's cache is), any other
    directory its absolute path; a name that resolves to nothing, as given (the load says why)."""
    try:
        root = resolve_hub_path(path)
    except (CheckpointPathError, FileNotFoundError):
        return os.fspath(path)
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(_ROOT_PREFIX):
        return "/".join(root.parts[-3:])
    return os.path.abspath(root)


def _snapshot(repo: str, revision: str | None, cache_dir: str | None, name: str, what: str) -> Path:
    if revision is not None:
        _check_revision(name, revision)
    try:
        import huggingface_hub.constants
    except ImportError:
        raise CheckpointPathError(
            [
                f"{what} resolving a Hugging Face hub name needs huggingface_hub "
                "(pip install 'fsdp_fp8[hf]'), or pass the snapshot directory itself"
            ]
        ) from None
    cache = cache_dir or huggingface_hub.constants.HF_HUB_CACHE
    repo_dir = Path(cache, _ROOT_PREFIX + repo.replace("/", "--"))
    _check_ref(name, revision or "main", repo_dir)
    wanted = f"{repo}@{revision}" if revision else repo
    try:
        folder = huggingface_hub.snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True)
    except Exception:  # LocalEntryNotFoundError, IncompleteSnapshotError, HFValidationError
        # Their text advises passing local_files_only=False, which no user of fsdp_fp8 can do.
        raise CheckpointPathError(
            [
                f"{what} no complete snapshot of {wanted} in the local Hugging Face cache {cache}; "
                "fsdp_fp8 never downloads: fetch it first (e.g. "
                f"`hf download {repo}{f' --revision {revision}' if revision else ''}`) or set HF_HUB_CACHE"
            ]
        ) from None
    return _check_snapshot(name, revision or "main", repo_dir, Path(folder))


def _check_revision(name: str, revision: str) -> None:
    if COMMIT_HASH.match(revision):
        return
    problem = ref_name_problem(revision)
    if problem is not None:
        raise HubNameRefused(
            [
                f"hub name {name!r}: revision {revision!r} is neither a commit hash nor a valid git ref name "
                f"({problem}); it could lead outside the cache, so it is refused"
            ]
        )


def _check_ref(name: str, revision: str, repo_dir: Path) -> None:
    """A ref file (``refs/<revision>``) must hold a commit hash: its text names the snapshot."""
    if COMMIT_HASH.match(revision):
        return
    ref = repo_dir / "refs" / revision
    if not ref.is_file():
        return  # no such ref: huggingface_hub reports the snapshot missing
    commit = ref.read_text(errors="replace").strip()
    if not COMMIT_HASH.match(commit):
        led = os.path.realpath(repo_dir / "snapshots" / commit) if commit else str(repo_dir / "snapshots")
        raise HubNameRefused(
            [
                f"hub name {name!r}: revision {revision!r}: {ref} holds {commit[:200]!r}, not a commit hash; "
                f"it would have led to {led}, so it is refused"
            ]
        )


def _check_snapshot(name: str, revision: str, repo_dir: Path, folder: Path) -> Path:
    """The snapshot, symlinks resolved, must be a directory directly inside ``snapshots/``."""
    snapshots = Path(os.path.realpath(repo_dir / "snapshots"))
    real = Path(os.path.realpath(folder))
    if real.parent != snapshots or not real.is_dir():
        raise HubNameRefused(
            [
                f"hub name {name!r}: revision {revision!r}: the snapshot {folder} resolves to {real}, "
                f"which is not a directory inside {snapshots}, so it is refused"
            ]
        )
    return folder
