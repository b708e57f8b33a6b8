"""Find which safetensors files make up a checkpoint directory, refusing anything unsafe.

Shard names come from a JSON file that anyone can edit, so each one must be a plain file
name inside the directory: an absolute path, ``..`` or a symlink that leaves the directory
is refused, never followed. Pickle checkpoints are refused without being opened, because
unpickling runs arbitrary code.
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_fp8.errors import CheckpointPathError
from fsdp_fp8.format.handles import open_regular, present, read_json_file, short_repr
from fsdp_fp8.format.hub import resolve_hub_path

WEIGHT_STEMS = ("model", "diffusion_pytorch_model")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


@dataclass(frozen=True)
class Layout:
    directory: Path
    index_file: str | None  # None for a single-file checkpoint
    files: tuple[str, ...]  # shard file names, sorted
    weight_map: dict[str, str] | None
    index: dict | None = field(default=None, compare=False)  # the parsed index file, for the ranks' agreement


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a whole file, read in 16 MiB blocks."""
    problems: list[str] = []
    handle = open_regular(Path(path), Path(path).name, problems)
    if handle is None:
        raise OSError(problems[0])
    digest, offset = hashlib.sha256(), 0
    try:
        while block := handle.pread(1 << 24, offset):
            digest.update(block)
            offset += len(block)
    finally:
        handle.close()
    return digest.hexdigest()


def resolve_directory(path: str | os.PathLike) -> Path:
    """The directory holding the weights: ``path`` itself (or, for a hub name, its cached
    snapshot: ``fsdp_fp8.format.hub``), or a diffusers pipeline's ``transformer/``."""
    directory = resolve_hub_path(path)
    where = "" if directory.is_absolute() else f" (relative to {os.getcwd()})"
    if not directory.exists():
        raise CheckpointPathError([f"checkpoint directory {directory} does not exist{where}"])
    if not directory.is_dir():
        raise CheckpointPathError([f"checkpoint path {directory} is not a directory{where}"])
    own = any(directory.glob("*.safetensors")) or any(directory.glob("*.safetensors.index.json"))
    if not own and (directory / "transformer").is_dir():
        return directory / "transformer"
    return directory


def hub_blobs(directory: Path) -> Path | None:
    """``<cache>/models--<org>--<name>/blobs`` when ``directory`` is one of that repo's snapshots.

    The Hugging Face hub cache keeps every file once, in ``blobs/``, and each snapshot
    ``snapshots/<revision>/<file>`` is a symlink to ``../../blobs/<hash>``. Links into that one
    folder are the cache's own layout; any other link still counts as leaving the directory.
    """
    snapshot = directory.resolve()
    repo = snapshot.parent.parent
    if snapshot.parent.name == "snapshots" and repo.name.startswith("models--"):
        return repo / "blobs"
    return None


def shard_path(directory: Path, name: object, what: str) -> tuple[Path | None, str | None]:
    """``directory / name`` if ``name`` is a safe, existing safetensors file there (that it is a
    regular file is checked when it is opened, without blocking: ``handles.open_regular``)."""
    if not isinstance(name, str) or not name:
        return None, f"{what} names {short_repr(name)}, which is not a file name"
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        return (
            None,
            f"{what} names the absolute path {short_repr(name)}; only file names inside {directory} are allowed",
        )
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        return None, f"{what} names {short_repr(name)}, which uses '..'; only file names inside {directory} are allowed"
    if len(parts) != 1 or name == ".":
        return None, f"{what} names {short_repr(name)}, which is not a plain file name"
    if not name.endswith(".safetensors"):
        return None, f"{what} names {short_repr(name)}, which is not a .safetensors file (pickles are never loaded)"
    path = directory / name
    try:  # a name too long for the filesystem, a loop of links, no permission: named, not raised
        if path.is_symlink() and path.resolve().parent not in (directory.resolve(), hub_blobs(directory)):
            return None, f"{what} names {short_repr(name)}, a symlink to {path.resolve()} outside {directory}"
        if not path.exists():
            return None, f"{what} names {short_repr(name)}, which does not exist in {directory}"
    except (OSError, RuntimeError) as exc:  # RuntimeError: Path.resolve on a symlink loop (3.11)
        return None, f"{what} names {short_repr(name)}, which cannot be looked up: {type(exc).__name__}: {exc}"
    return path, None


def _read_index(directory: Path, index_file: str, problems: list[str]) -> tuple[dict | None, dict | None]:
    """(weight_map, the whole index) when the index is usable."""
    obj = read_json_file(directory / index_file, index_file, problems)
    if obj is None:
        return None, None
    weight_map = obj.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        problems.append(f"{index_file}: `weight_map` is missing, empty or not an object")
        return None, obj
    if "metadata" in obj and not isinstance(obj["metadata"], dict):
        problems.append(f"{index_file}: `metadata` is not an object")
    return weight_map, obj


def find_layout(directory: Path, problems: list[str]) -> Layout | None:
    """The checkpoint's files, or None (with the reason in ``problems``) when there are none to read."""
    indexes = sorted(p.name for p in directory.glob("*.safetensors.index.json"))
    singles = [f"{s}.safetensors" for s in WEIGHT_STEMS if present(directory / f"{s}.safetensors")]
    if len(indexes) + len(singles) > 1:
        problems.append(
            f"{directory}: ambiguous checkpoint, found {indexes + singles}; expected one "
            "index or one single-file checkpoint"
        )
        return None
    if indexes:
        weight_map, index = _read_index(directory, indexes[0], problems)
        if weight_map is None:
            return None
        keys_of: dict[str, list[str]] = defaultdict(list)  # one pass: linear in the index size
        for key, name in weight_map.items():
            if isinstance(name, str):
                keys_of[name].append(key)
            else:
                problems.append(f"{indexes[0]}: `{key}` maps to {short_repr(name)}, not a file name")
        files = set()
        for name, keys in sorted(keys_of.items()):
            _, problem = shard_path(directory, name, f"{indexes[0]} (for `{min(keys)}` and {len(keys) - 1} more)")
            if problem:
                problems.append(problem)
            else:
                files.add(name)
        return Layout(directory, indexes[0], tuple(sorted(files)), weight_map, index)
    if singles:
        _, problem = shard_path(directory, singles[0], str(directory))
        if problem:
            problems.append(problem)
            return None
        return Layout(directory, None, (singles[0],), None)
    pickles = sorted(
        p.name for p in directory.iterdir() if p.name.endswith(PICKLE_SUFFIXES) or p.name.endswith(".bin.index.json")
    )
    others = sorted(p.name for p in directory.glob("*.safetensors"))
    if pickles:
        problems.append(
            f"{directory}: only pickle checkpoint files {pickles}; they are never unpickled "
            "(arbitrary code), convert them to safetensors"
        )
    elif others:
        problems.append(
            f"{directory}: safetensors files {others} but no model.safetensors, "
            "diffusion_pytorch_model.safetensors or *.safetensors.index.json"
        )
    else:
        problems.append(f"{directory}: no safetensors checkpoint (no *.safetensors or *.safetensors.index.json)")
    return None
