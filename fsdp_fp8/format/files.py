"""Find which safetensors files make up a checkpoint directory, refusing anything unsafe.

Shard names come from a JSON file that anyone can edit, so each one must be a plain file
name inside the directory: an absolute path, ``..`` or a symlink that leaves the directory
is refused, never followed. Pickle checkpoints are refused without being opened, because
unpickling runs arbitrary code.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from fsdp_fp8.format.hub import resolve_hub_path
from fsdp_fp8.format.safetensors_header import load_json_object

WEIGHT_STEMS = ("model", "diffusion_pytorch_model")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


@dataclass(frozen=True)
class Layout:
    directory: Path
    index_file: str | None  # None for a single-file checkpoint
    files: tuple[str, ...]  # shard file names, sorted
    weight_map: dict[str, str] | None


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a whole file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def resolve_directory(path: str | os.PathLike) -> Path:
    """The directory holding the weights: ``path`` itself (or, for a hub name, its cached
    snapshot: ``fsdp_fp8.format.hub``), or a diffusers pipeline's ``transformer/``."""
    directory = resolve_hub_path(path)
    if not directory.exists():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    if not directory.is_dir():
        raise NotADirectoryError(f"checkpoint path {directory} is not a directory")
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
    """``directory / name`` if ``name`` is a safe, existing safetensors file there."""
    if not isinstance(name, str) or not name:
        return None, f"{what} names {name!r}, which is not a file name"
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        return None, f"{what} names the absolute path {name!r}; only file names inside {directory} are allowed"
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        return None, f"{what} names {name!r}, which uses '..'; only file names inside {directory} are allowed"
    if len(parts) != 1 or name == ".":
        return None, f"{what} names {name!r}, which is not a plain file name"
    if not name.endswith(".safetensors"):
        return None, f"{what} names {name!r}, which is not a .safetensors file (pickles are never loaded)"
    path = directory / name
    if path.is_symlink() and path.resolve().parent not in (directory.resolve(), hub_blobs(directory)):
        return None, f"{what} names {name!r}, a symlink to {path.resolve()} outside {directory}"
    if not path.exists():
        return None, f"{what} names {name!r}, which does not exist in {directory}"
    if not path.is_file():
        return None, f"{what} names {name!r}, which is not a regular file"
    return path, None


def _read_index(directory: Path, index_file: str, problems: list[str]) -> dict[str, str] | None:
    obj = load_json_object((directory / index_file).read_bytes(), index_file, problems)
    if obj is None:
        return None
    weight_map = obj.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        problems.append(f"{index_file}: `weight_map` is missing, empty or not an object")
        return None
    if "metadata" in obj and not isinstance(obj["metadata"], dict):
        problems.append(f"{index_file}: `metadata` is not an object")
    return weight_map


def find_layout(directory: Path, problems: list[str]) -> Layout | None:
    """The checkpoint's files, or None (with the reason in ``problems``) when there are none to read."""
    indexes = sorted(p.name for p in directory.glob("*.safetensors.index.json"))
    singles = [f"{s}.safetensors" for s in WEIGHT_STEMS if (directory / f"{s}.safetensors").exists()
               or (directory / f"{s}.safetensors").is_symlink()]
    if len(indexes) + len(singles) > 1:
        problems.append(f"{directory}: ambiguous checkpoint, found {indexes + singles}; expected one "
                        "index or one single-file checkpoint")
        return None
    if indexes:
        weight_map = _read_index(directory, indexes[0], problems)
        if weight_map is None:
            return None
        files = set()
        for name in sorted({v for v in weight_map.values() if isinstance(v, str)}):
            keys = sorted(k for k, v in weight_map.items() if v == name)
            _, problem = shard_path(directory, name, f"{indexes[0]} (for `{keys[0]}` and {len(keys) - 1} more)")
            if problem:
                problems.append(problem)
            else:
                files.add(name)
        for key, name in weight_map.items():
            if not isinstance(name, str):
                problems.append(f"{indexes[0]}: `{key}` maps to {name!r}, not a file name")
        return Layout(directory, indexes[0], tuple(sorted(files)), weight_map)
    if singles:
        _, problem = shard_path(directory, singles[0], str(directory))
        if problem:
            problems.append(problem)
            return None
        return Layout(directory, None, (singles[0],), None)
    pickles = sorted(p.name for p in directory.iterdir()
                     if p.name.endswith(PICKLE_SUFFIXES) or p.name.endswith(".bin.index.json"))
    others = sorted(p.name for p in directory.glob("*.safetensors"))
    if pickles:
        problems.append(f"{directory}: only pickle checkpoint files {pickles}; they are never unpickled "
                        "(arbitrary code), convert them to safetensors")
    elif others:
        problems.append(f"{directory}: safetensors files {others} but no model.safetensors, "
                        "diffusion_pytorch_model.safetensors or *.safetensors.index.json")
    else:
        problems.append(f"{directory}: no safetensors checkpoint (no *.safetensors or *.safetensors.index.json)")
    return None
